"""Hugging Face Gemma 4 checkpoint -> GGUF in llama.cpp's `gemma4` layout.

    python -m gemma4_mlx.convert HF_DIR OUT.gguf --type {f32,f16,bf16,q8_0,q4_0}

Writes text weights only (vision/audio towers are skipped), with llama.cpp's tensor names
(`weights.py`), metadata keys and types (`ModelConfig.to_gguf_metadata` + tokenizer metadata +
general.file_type / quantization_version / sampling), and its dtype rule (gemma4-spec.md §7.5):

- F32: tensors with <= 1 dim, names ending `_norm.weight`, the router `ffn_gate_inp.*`, and names
  not ending in `.weight` (`ffn_gate_inp.scale`, `ffn_down_exps.scale`);
- every other tensor: the requested type. For q8_0/q4_0, a tensor whose rows (ne[0], the last numpy
  dim) are not a multiple of 32 cannot be block-quantised and is written BF16 instead (lossless for
  the bf16 published checkpoints, no fp16 range loss; llama.cpp's converter uses F16 here).

`rope_freqs.weight` (F32, [global_head_dim/2] = [1.0]*n_rot_pairs + [1e30]*rest) is synthesised, and
`token_embd` is trimmed to the tokenizer's vocabulary if the checkpoint has more rows. Expert tensors
stay fused (gate|up). KV-shared layers' unused k/v/k_norm are written when the checkpoint has them.

Memory: tensors are read one at a time through numpy memory maps of the safetensors shards and
encoded in row chunks; the output is streamed with gguf.GGUFWriter (tensor infos first, data after),
so peak memory is about one source tensor plus its encoded bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from . import quants
from .config import ConfigError, ModelConfig
from .weights import ROPE_FREQS, UnknownTensorName, hf_to_gguf_name

__all__ = ["ConvertError", "OUT_TYPES", "SafetensorsCheckpoint", "PlannedTensor", "output_ggml_type",
           "plan_tensors", "gguf_metadata", "convert", "main"]

F32, F16, Q4_0, Q8_0, BF16 = quants.F32, quants.F16, quants.Q4_0, quants.Q8_0, quants.BF16

# --type -> (ggml type of the quantised matrices, general.file_type)
OUT_TYPES: dict[str, tuple[int, int]] = {
    "f32": (F32, 0),
    "f16": (F16, 1),
    "bf16": (BF16, 32),
    "q8_0": (Q8_0, 7),
    "q4_0": (Q4_0, 2),
}
QUANTIZATION_VERSION = 2
SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
_BLOCK_TYPES = {Q4_0: (32, 18), Q8_0: (32, 34)}
_FLOAT_BYTES = {F32: 4, F16: 2, BF16: 2}
_ROW_CHUNK_ELEMS = 1 << 24  # elements converted to float32 at a time (64 MB)


class ConvertError(Exception):
    """A checkpoint that cannot be converted; the message is one line meant for the user."""


# ------------------------------------------------------------------------------------------
# reading safetensors shards


_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}


@dataclass(frozen=True)
class _StEntry:
    file: Path
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offset in file
    end: int


class SafetensorsCheckpoint:
    """The tensors of a (possibly sharded) safetensors checkpoint, read lazily one at a time.

    The safetensors header (u64 length + JSON) is parsed directly and data is memory-mapped with
    numpy: the `safetensors` package's numpy backend cannot return bfloat16, the dtype of every
    published Gemma 4 checkpoint.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConvertError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted({self.dir / f for f in weight_map.values()})
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"no *.safetensors files in {self.dir}")
        self.entries: dict[str, _StEntry] = {}
        for f in files:
            if not f.exists():
                raise ConvertError(f"safetensors shard {f.name} listed in the index is missing")
            for name, entry in self._read_header(f).items():
                if name in self.entries:
                    raise ConvertError(f"tensor {name} appears in both {self.entries[name].file.name} and {f.name}")
                self.entries[name] = entry

    @staticmethod
    def _read_header(path: Path) -> dict[str, _StEntry]:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path.name} is too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ConvertError(f"{path.name}: safetensors header length {n} exceeds the file size")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConvertError(f"{path.name}: bad safetensors header: {e}") from None
        base = 8 + n
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (a, b) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if dtype not in _ST_DTYPES:
                raise ConvertError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
            if b - a != math.prod(shape) * _ST_DTYPES[dtype].itemsize or base + b > size:
                raise ConvertError(f"{path.name}: tensor {name} byte range {a}..{b} does not match shape {shape}")
            out[name] = _StEntry(path, dtype, shape, base + a, base + b)
        return out

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def raw(self, name: str) -> np.ndarray:
        """Read-only memory-mapped array in the stored dtype (BF16 as uint16 bit patterns)."""
        e = self.entries[name]
        dt = _ST_DTYPES[e.dtype]
        if e.end == e.start:
            return np.zeros(e.shape, dtype=dt)
        return np.memmap(e.file, dtype=dt, mode="r", offset=e.start, shape=e.shape)

    def dtype_name(self, name: str) -> str:
        return self.entries[name].dtype


def _to_f32(x: np.ndarray, st_dtype: str) -> np.ndarray:
    return quants.bf16_to_f32(x) if st_dtype == "BF16" else np.asarray(x, dtype=np.float32)


# ------------------------------------------------------------------------------------------
# planning


def output_ggml_type(gguf_name: str, shape: tuple[int, ...], requested: int) -> int:
    """ggml type of one tensor for a requested file type (the F32 rule and the quant fallback)."""
    if (len(shape) <= 1 or gguf_name.endswith("_norm.weight") or ".ffn_gate_inp." in gguf_name
            or not gguf_name.endswith(".weight")):
        return F32
    if requested in _BLOCK_TYPES and shape[-1] % _BLOCK_TYPES[requested][0]:
        return BF16
    return requested


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    n = math.prod(shape)
    if ggml_type in _BLOCK_TYPES:
        elems, size = _BLOCK_TYPES[ggml_type]
        return n // elems * size
    return n * _FLOAT_BYTES[ggml_type]


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: GGUF name, HF source name (None: synthesised), numpy shape as written
    (after vocab trimming), ggml type and byte count."""

    gguf_name: str
    hf_name: str | None
    shape: tuple[int, ...]
    ggml_type: int
    nbytes: int


def _load_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path} is not valid JSON: {e}") from None


def read_hf_config(hf_dir: Path) -> tuple[dict[str, Any], ModelConfig]:
    """(config.json dict, ModelConfig); ConvertError for a missing dir/config or unsupported model."""
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir} is not a directory")
    raw = _load_json(hf_dir / "config.json")
    if raw is None:
        raise ConvertError(f"no config.json in {hf_dir}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(f"unsupported model_type {model_type!r} in {hf_dir / 'config.json'} "
                           f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    text = raw.get("text_config") or raw
    if text.get("tie_word_embeddings", raw.get("tie_word_embeddings", True)) is False:
        raise ConvertError("untied output head (tie_word_embeddings: false) is not a Gemma 4 layout")
    try:
        cfg = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise ConvertError(f"config.json: {e}") from None
    return raw, cfg


def plan_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, n_vocab: int, requested: int) -> list[PlannedTensor]:
    """Map, validate and type every text tensor of the checkpoint (+ rope_freqs), in GGUF order.

    Raises ConvertError for unknown names, duplicates, missing tensors and shape mismatches."""
    sources: dict[str, str] = {}
    for hf_name in ckpt.names:
        try:
            gguf_name = hf_to_gguf_name(hf_name)
        except UnknownTensorName as e:
            raise ConvertError(str(e)) from None
        if gguf_name is None:
            continue
        if gguf_name in sources:
            raise ConvertError(f"tensors {sources[gguf_name]} and {hf_name} both map to {gguf_name}")
        sources[gguf_name] = hf_name
    if not sources:
        raise ConvertError(f"no Gemma 4 text-model tensors in {ckpt.dir}")
    shapes = {g: ckpt.shape(h) for g, h in sources.items()}
    shapes[ROPE_FREQS] = (cfg.global_head_dim // 2,)
    try:
        cfg.check_tensor_shapes(shapes)
    except ConfigError as e:
        raise ConvertError(f"checkpoint does not match its config.json: {e}") from None
    v_model = shapes["token_embd.weight"][0]
    if n_vocab > v_model:
        raise ConvertError(f"the tokenizer has {n_vocab} tokens but token_embd has only {v_model} rows")
    shapes["token_embd.weight"] = (n_vocab, shapes["token_embd.weight"][1])

    order = {name: i for i, name in enumerate(cfg.expected_tensor_shapes())}
    plan = []
    for name in sorted(shapes, key=lambda n: order[n]):
        shape = tuple(shapes[name])
        t = output_ggml_type(name, shape, requested)
        plan.append(PlannedTensor(name, sources.get(name), shape, t, _nbytes(t, shape)))
    return plan


def gguf_metadata(hf_dir: Path, cfg: ModelConfig, tokenizer_md: dict[str, Any], tokenizer_ty: dict[str, Any],
                  file_type: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, metadata_types) in llama.cpp's order: general.*, gemma4.*, tokenizer.*."""
    md_model, ty_model = cfg.to_gguf_metadata()
    md: dict[str, Any] = {"general.architecture": md_model.pop("general.architecture")}
    ty: dict[str, Any] = {"general.architecture": ty_model.pop("general.architecture")}
    md["general.type"], ty["general.type"] = "model", 8
    md["general.name"], ty["general.name"] = hf_dir.resolve().name, 8
    gen = _load_json(hf_dir / "generation_config.json") or {}
    for hf_key, key, code in (("top_k", "general.sampling.top_k", 5), ("top_p", "general.sampling.top_p", 6),
                              ("temperature", "general.sampling.temp", 6)):
        if gen.get(hf_key) is not None:
            md[key] = int(gen[hf_key]) if code == 5 else float(gen[hf_key])
            ty[key] = code
    md["general.file_type"], ty["general.file_type"] = file_type, 4
    md["general.quantization_version"], ty["general.quantization_version"] = QUANTIZATION_VERSION, 4
    md.update(md_model)
    ty.update(ty_model)
    for key, value in tokenizer_md.items():
        if value is not None:
            md[key], ty[key] = value, tokenizer_ty[key]
    return md, ty


# ------------------------------------------------------------------------------------------
# encoding and writing


def _encode(src: np.ndarray, st_dtype: str, ggml_type: int, nbytes: int) -> np.ndarray:
    """Source tensor (stored dtype) -> uint8 bytes of ggml_type, converted in row chunks."""
    if src.ndim == 0:
        src = src.reshape(1)
    rows = src.reshape(-1, src.shape[-1])
    out = np.empty(nbytes, dtype=np.uint8).reshape(rows.shape[0], -1)
    step = max(1, _ROW_CHUNK_ELEMS // rows.shape[1])
    for a in range(0, rows.shape[0], step):
        out[a:a + step] = quants.quantize(_to_f32(rows[a:a + step], st_dtype), ggml_type)
    return out.reshape(-1)


def _rope_freqs_bytes(cfg: ModelConfig) -> np.ndarray:
    return np.asarray(cfg.rope_freqs(), dtype="<f4").view(np.uint8)


def _write_streaming(path: Path, metadata: dict[str, Any], metadata_types: dict[str, Any],
                     plan: list[PlannedTensor], produce: Callable[[PlannedTensor], np.ndarray],
                     progress: bool, desc: str = "") -> None:
    """Write a GGUF with gguf.GGUFWriter: tensor infos from `plan` first, then each tensor's bytes
    from `produce` as they are made (one tensor in memory at a time)."""
    import gguf

    writer = gguf.GGUFWriter(path, metadata["general.architecture"])
    try:
        for key, value in metadata.items():
            if key == "general.architecture":
                continue
            code = metadata_types[key]
            if isinstance(code, tuple):
                items = value.tolist() if isinstance(value, np.ndarray) else list(value)
                writer.add_key_value(key, items, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(int(code[1])))
            else:
                if isinstance(value, np.generic):
                    value = value.item()
                writer.add_key_value(key, value, gguf.GGUFValueType(int(code)))
        for t in plan:
            writer.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.float32), t.nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType(t.ggml_type))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(t.nbytes for t in plan), unit="B", unit_scale=True, desc=desc or path.name)
        for t in plan:
            data = produce(t)
            if data.nbytes != t.nbytes:
                raise ConvertError(f"internal: {t.gguf_name} encoded to {data.nbytes} bytes, planned {t.nbytes}")
            writer.write_tensor_data(data)
            if bar is not None:
                bar.update(t.nbytes)
        if bar is not None:
            bar.close()
    finally:
        writer.close()


def _tokenizer_metadata(hf_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from .tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_hf_dir(hf_dir)
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot load the tokenizer from {hf_dir}: {e}") from None
    return tok.to_gguf_metadata()


def convert(hf_dir: str | os.PathLike, out_path: str | os.PathLike, out_type: str = "bf16",
            progress: bool = False) -> Path:
    """Convert an HF Gemma 4 checkpoint directory to one GGUF file; returns the output path.

    out_type: one of OUT_TYPES. The file is written to OUT.tmp-PID and renamed when complete.
    Raises ConvertError with a one-line message for unusable input."""
    if out_type not in OUT_TYPES:
        raise ConvertError(f"unknown output type {out_type!r} (choose from {', '.join(OUT_TYPES)})")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    requested, file_type = OUT_TYPES[out_type]
    _, cfg = read_hf_config(hf_dir)
    ckpt = SafetensorsCheckpoint(hf_dir)
    tok_md, tok_ty = _tokenizer_metadata(hf_dir)
    n_vocab = len(tok_md["tokenizer.ggml.tokens"])
    plan = plan_tensors(ckpt, cfg, n_vocab, requested)
    metadata, metadata_types = gguf_metadata(hf_dir, cfg, tok_md, tok_ty, file_type)

    def produce(t: PlannedTensor) -> np.ndarray:
        if t.hf_name is None:
            return _rope_freqs_bytes(cfg)
        src = ckpt.raw(t.hf_name)
        if t.gguf_name == "token_embd.weight":
            src = src[: t.shape[0]]
        return _encode(src, ckpt.dtype_name(t.hf_name), t.ggml_type, t.nbytes)

    tmp = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    try:
        _write_streaming(tmp, metadata, metadata_types, plan, produce, progress, desc=out_path.name)
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out_path


# ------------------------------------------------------------------------------------------
# CLI


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemma4_mlx.convert",
                                     description="Convert a Hugging Face Gemma 4 checkpoint to GGUF (llama.cpp layout).")
    parser.add_argument("hf_dir", help="directory with config.json, *.safetensors and tokenizer.json")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--type", dest="out_type", choices=list(OUT_TYPES), default="bf16",
                        help="type of the weight matrices (norms, router and scales stay F32); default bf16")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        out = convert(args.hf_dir, args.out, args.out_type, progress=not args.no_progress)
    except (ConvertError, ConfigError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
