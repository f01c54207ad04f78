"""Random-weight GGUF files at the shapes of real models, for benchmarking at sizes the bundled
135M model does not reach.

    python -m benchmarks.llamacpp.random_gguf 0.5b        # prints the F16 file (written once)
    python -m benchmarks.llamacpp.random_gguf 1b --quantize Q4_K_M

Presets: ``0.5b`` has Qwen2.5-0.5B's shapes (architecture ``qwen2``: hidden 896, 24 layers, 14 query
/ 2 key-value heads, intermediate 4864, vocabulary 151,936, biased q/k/v projections, tied
embeddings); ``1b`` has Llama-3.2-1B's (``llama``: hidden 2048, 16 layers, 32 / 8 heads,
intermediate 8192, vocabulary 128,256, tied embeddings, rope theta 500,000, without its long context
rope scaling); ``3b`` has Llama-3.2-3B's (``llama``: hidden 3072, 28 layers, 24 / 8 heads,
intermediate 8192, the same vocabulary, tied embeddings); ``tiny`` is a few-kilobyte ``llama`` for
tests. Matrices and the embedding are normal with std 0.02 in F16, norms are ones and biases zeros
in F32, as llama.cpp's converter stores them; the vocabulary is
``benchmarks/llamacpp/synthetic_vocab.py``'s. Both llama.cpp and pdserve's loader read the files;
the text a random model writes means nothing, its speed is the point.

Each file is written once, tensor by tensor (the 1B file is about 2.5 GB and never whole in
memory), into ``<cache>/gguf/random-<preset>-f16.gguf``, by rename once complete; ``--quantize``
makes a llama-quantize copy next to it (``benchmarks/llamacpp/requantize.py``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType

from benchmarks.llamacpp.synthetic_vocab import synthetic_vocab
from engine.model.gguf_cache import cache_root

WEIGHT_STD = 0.02
ROWS_PER_DRAW = 8192  # rows drawn at once: bounds the fp32 scratch of the largest matrix


@dataclass(frozen=True)
class ModelShape:
    """The shape of one architecture's model: everything the GGUF header states."""

    arch: str  # llama or qwen2
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    qkv_bias: bool
    rope_theta: float
    rms_norm_eps: float
    context_length: int

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"arch must be llama or qwen2, got {self.arch!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must split into heads, heads into key-value groups")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS = {
    "0.5b": ModelShape("qwen2", 896, 24, 14, 2, 4864, 151_936, True, 1_000_000.0, 1e-6, 32_768),
    "1b": ModelShape("llama", 2048, 16, 32, 8, 8192, 128_256, False, 500_000.0, 1e-5, 131_072),
    "3b": ModelShape("llama", 3072, 28, 24, 8, 8192, 128_256, False, 500_000.0, 1e-5, 131_072),
    "tiny": ModelShape("llama", 64, 2, 4, 2, 128, 320, False, 10_000.0, 1e-5, 2048),
}


def tensor_shapes(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape ``[out, in]``) of every tensor, in file order; no ``output``:
    the embedding is tied."""
    kv = shape.num_kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab_size, shape.hidden_size)
    for layer in range(shape.num_layers):
        parts = [("attn_norm.weight", (shape.hidden_size,))]
        for name, rows in (("attn_q", shape.hidden_size), ("attn_k", kv), ("attn_v", kv)):
            parts.append((f"{name}.weight", (rows, shape.hidden_size)))
            if shape.qkv_bias:
                parts.append((f"{name}.bias", (rows,)))
        parts += [
            ("attn_output.weight", (shape.hidden_size, shape.hidden_size)),
            ("ffn_norm.weight", (shape.hidden_size,)),
            ("ffn_gate.weight", (shape.intermediate_size, shape.hidden_size)),
            ("ffn_up.weight", (shape.intermediate_size, shape.hidden_size)),
            ("ffn_down.weight", (shape.hidden_size, shape.intermediate_size)),
        ]
        yield from ((f"blk.{layer}.{name}", dims) for name, dims in parts)
    yield "output_norm.weight", (shape.hidden_size,)


def _tensor(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norms ones, biases zeros (F32); matrices normal with ``WEIGHT_STD`` (F16)."""
    if len(dims) == 1:
        return (np.ones if name.endswith("norm.weight") else np.zeros)(dims, dtype=np.float32)
    matrix = np.empty(dims, dtype=np.float16)
    for start in range(0, dims[0], ROWS_PER_DRAW):
        rows = matrix[start : start + ROWS_PER_DRAW]
        rows[:] = rng.standard_normal(rows.shape, dtype=np.float32) * WEIGHT_STD
    return matrix


def write_header(writer: GGUFWriter, preset: str, shape: ModelShape) -> None:
    """Everything but the tensors: the model's shape, its name and the synthetic vocabulary."""
    writer.add_name(f"random-{preset}")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    vocab = synthetic_vocab(shape.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if shape.arch == "qwen2" else "llama-bpe")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_add_bos_token(shape.arch == "llama")


def write_random_gguf(path: Path, preset: str, shape: ModelShape, seed: int = 0) -> Path:
    """Write ``shape`` with random weights to ``path`` (through ``path.partial``, renamed)."""
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, shape.arch)
    write_header(writer, preset, shape)
    for name, dims in tensor_shapes(shape):
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensor_shapes(shape):
        writer.write_tensor_data(_tensor(name, dims, rng))
    writer.close()
    os.replace(partial, path)
    return path


def random_gguf_path(preset: str, folder: Path | None = None) -> Path:
    """The F16 file of ``preset``, written first when absent."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    folder = folder or cache_root() / "gguf"
    path = folder / f"random-{preset}-f16.gguf"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once)", flush=True)
        write_random_gguf(path, preset, PRESETS[preset])
    return path


def tiny_shape(arch: str = "llama") -> ModelShape:
    """The ``tiny`` preset, in ``arch`` (``qwen2``: with its q/k/v biases)."""
    return replace(PRESETS["tiny"], arch=arch, qkv_bias=arch == "qwen2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset", choices=PRESETS)
    parser.add_argument("--quantize", help="also a llama-quantize copy of this type (Q4_K_M, ...)")
    args = parser.parse_args()
    path = random_gguf_path(args.preset)
    if args.quantize:
        from benchmarks.llamacpp.requantize import requantized_path

        path = requantized_path(path, args.quantize)
    print(path)


if __name__ == "__main__":
    main()
