"""Logit lens: project every layer's hidden state through the final norm and the tied head.

    python examples/logit_lens.py [--model PATH] [--prompt TEXT] [--top 5]

`model(tokens, return_hidden_states=True)` returns (logits, hidden): hidden[0] is the scaled token
embedding and hidden[i + 1] the output of decoder layer i, each [B, T, H] before the final norm.
`model.logits(model.model.norm(h))` is what the model would predict if it stopped after that layer
(the last layer's projection is exactly the model's output).
"""

import argparse

import gemma4_mlx  # noqa: F401  (first: sets up MLX's CPU BLAS)
import mlx.core as mx

from gemma4_mlx.generate import load


def top_tokens(logits: mx.array, tokenizer, k: int) -> str:
    """logits fp32 [V] -> "'tok' p  'tok' p ..." for the k most likely tokens."""
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-probs)[:k].tolist()
    return "  ".join(f"{tokenizer.decode([t])!r} {probs[t].item():.3f}" for t in order)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a .gguf file, an HF directory, a cached repo id, or 'demo'")
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy")
    ap.add_argument("--top", type=int, default=5, help="tokens shown per layer")
    ap.add_argument("--position", type=int, default=-1, help="prompt position to inspect (default: the last)")
    args = ap.parse_args()

    model, tokenizer = load(args.model, dtype="float32", progress=False)
    ids = tokenizer.encode(args.prompt, add_bos=True)
    logits, hidden = model(mx.array([ids]), return_hidden_states=True)
    pos = args.position
    print(f"prompt: {len(ids)} tokens; inspecting position {pos % len(ids)} ({tokenizer.decode([ids[pos]])!r})")
    for i, h in enumerate(hidden):
        label = "embed   " if i == 0 else f"layer {i - 1:2d}"
        lens = model.logits(model.model.norm(h[0, pos]))
        print(f"{label}  {top_tokens(lens, tokenizer, args.top)}")
    print(f"output    {top_tokens(logits[0, pos], tokenizer, args.top)}")


if __name__ == "__main__":
    main()
