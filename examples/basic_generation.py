"""Basic generation with the library API: load, chat template, generate, stream with per-token logprobs.

    python examples/basic_generation.py                       # the built-in demo model (meaningless text)
    python examples/basic_generation.py --model gemma-4-E2B-it-Q4_0.gguf --prompt "Why is the sky blue?"
"""

import argparse

import gemma4_mlx  # noqa: F401  (first: sets up MLX's CPU BLAS)
import mlx.core as mx

from gemma4_mlx.generate import generate, load, stream_generate
from gemma4_mlx.sampling import make_sampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a .gguf file, an HF directory, a cached repo id, or 'demo'")
    ap.add_argument("--prompt", default="Write one sentence about the sea.")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    model, tokenizer = load(args.model, progress=False)
    cfg = model.cfg
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")

    # 1. The chat template gives token ids (user text is never parsed into control tokens).
    ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    print(f"prompt: {len(ids)} tokens")

    # 2. One call: the answer text; verbose=True streams it and prints mlx-lm's three stats lines.
    sampler = make_sampler(temp=args.temp, seed=args.seed)
    text = generate(model, tokenizer, ids, max_tokens=args.max_tokens, sampler=sampler, verbose=True)
    print(f"generate() returned {len(text)} characters")

    # 3. Streaming: every step has the token id, its text and the full log-probability vector.
    print("token      logprob  text")
    sampler = make_sampler(temp=args.temp, seed=args.seed)
    for r in stream_generate(model, tokenizer, ids, max_tokens=8, sampler=sampler):
        if r.token is None:
            break
        lp = r.logprobs[r.token].item()
        print(f"{r.token:6d}  {lp:9.4f}  {r.text!r}" + (f"  [finish: {r.finish_reason}]" if r.finish_reason else ""))

    # 4. The model itself: logits fp32 [B, T, V] for any token batch.
    logits = model(mx.array([ids]))
    print(f"model(tokens) -> logits {tuple(logits.shape)} {logits.dtype}")


if __name__ == "__main__":
    main()
