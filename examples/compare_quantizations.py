"""Compare Q4_0 / Q8_0 / BF16 weights of one model against its float weights: logit NMSE and top-1 agreement.

    python examples/compare_quantizations.py [--model PATH] [--tokens 64]

Every weight matrix of the model is taken in float32 (dequantized if the file is quantized; an HF directory
is converted to an F32 GGUF first), written again as an F32, BF16, Q8_0 and Q4_0 GGUF (norms and scales stay
F32, as llama.cpp writes them), and each file is run in float32 activations on the same tokens. The F32 file
is the reference, so the numbers measure the weight format alone.
"""

import argparse
import tempfile
from pathlib import Path

import gemma4_mlx  # noqa: F401  (first: sets up MLX's CPU BLAS)
import mlx.core as mx
import numpy as np

from gemma4_mlx import quants
from gemma4_mlx.convert import OUT_TYPES, convert, output_ggml_type
from gemma4_mlx.generate import load, resolve_model_path
from gemma4_mlx.gguf import read_gguf, write_gguf
from gemma4_mlx.tokenizer_train import DEFAULT_TRAINING_TEXT

BITS_PER_WEIGHT = {"f32": 32.0, "bf16": 16.0, "q8_0": 8.5, "q4_0": 4.5}


def rewrite(src: Path, dst: Path, out_type: str) -> None:
    """Write src's tensors, through float32, as an `out_type` GGUF with the same metadata."""
    requested, file_type = OUT_TYPES[out_type]
    g = read_gguf(src)
    try:
        md, ty = dict(g.metadata), dict(g.metadata_types)
        md["general.file_type"], ty["general.file_type"] = file_type, 4
        tensors = []
        for name, t in g.tensors.items():
            values = quants.dequantize(t.data, t.ggml_type, t.shape).reshape(t.shape)
            ggml_type = output_ggml_type(name, t.shape, requested)
            tensors.append((name, ggml_type, t.shape, quants.quantize(values, ggml_type)))
        write_gguf(dst, md, ty, tensors, alignment=g.alignment)
    finally:
        g.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a .gguf file, an HF directory, a cached repo id, or 'demo'")
    ap.add_argument("--tokens", type=int, default=64, help="probe length in tokens")
    ap.add_argument("--types", default="bf16,q8_0,q4_0", help="comma-separated formats to compare")
    args = ap.parse_args()

    kind, path = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if kind == "hf":
            source = convert(path, tmp / "source-f32.gguf", "f32")
        else:
            source = path
        files = {t: tmp / f"{t}.gguf" for t in ["f32", *args.types.split(",")]}
        for out_type, f in files.items():
            rewrite(source, f, out_type)

        reference, tokenizer = load(files["f32"], dtype="float32", progress=False)
        ids = tokenizer.encode(DEFAULT_TRAINING_TEXT, add_bos=True)[: args.tokens]
        tokens = mx.array([ids])
        ref = np.array(reference(tokens)[0], dtype=np.float64)
        del reference
        print(f"reference: float32 weights of {args.model}, {len(ids)} probe tokens, float32 activations")
        print(f"{'type':6s} {'bits/weight':>11s} {'NMSE':>10s} {'top-1 agreement':>16s}")
        for out_type, f in files.items():
            if out_type == "f32":
                continue
            model, _ = load(f, dtype="float32", progress=False)
            logits = np.array(model(tokens)[0], dtype=np.float64)
            nmse = float(((logits - ref) ** 2).sum() / (ref ** 2).sum())
            agree = float((logits.argmax(-1) == ref.argmax(-1)).mean())
            print(f"{out_type:6s} {BITS_PER_WEIGHT[out_type]:11.1f} {nmse:10.3e} {100 * agree:15.1f}%")


if __name__ == "__main__":
    main()
