"""A tiny random-weight Llama GGUF: what `llmgw up` serves when the starter model cannot be had,
and the model tests and benchmarks run engines with.

The model has real llama.cpp structure (2 layers, n_embd 64, 4 heads,
context 8192) and the real Llama SentencePiece vocabulary copied from
``ggml-vocab-llama-spm.gguf`` in the pinned llama-cpp-python sdist, so
tokenisation and usage counts behave like a real model; its weights are
noise, so its text is noise too. It is about 9 MB and answers in
milliseconds on a CPU.

The file is deterministic: a fixed seed and a fixed write order give the
same bytes every time (for a given numpy), so it can be cached and compared.

Serving it with llama-server (llama.cpp in llama-cpp-python 0.3.36)::

    llama-server -m tiny.gguf --jinja                 # chat + completions
    llama-server -m tiny.gguf --jinja --embeddings --pooling mean   # + embeddings

* ``--jinja`` makes llama-server apply the GGUF's ``tokenizer.chat_template``
  (a ChatML-like template written here).
* ``/v1/embeddings`` needs ``--embeddings``; without it the server answers
  501 "This server does not support embeddings. Start it with `--embeddings`".
  A Llama GGUF has no pooling type, so without ``--pooling`` the pooling is
  ``none``, which the OpenAI route rejects ("Pooling type 'none' is not OAI
  compatible"): pass ``--pooling mean`` (or ``last``). With both flags,
  ``/v1/chat/completions`` and ``/v1/completions`` keep working on this
  version; the same server can serve all three routes.
* ``--metrics`` enables ``/metrics``.

The output row of the end-of-sequence token is zero, so its logit is always
0 while the other 32k logits are random: the model practically never stops
early and ``completion_tokens`` equals ``max_tokens``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmgw.files import write_atomic

if TYPE_CHECKING:
    from gguf import GGUFValueType

SEED = 20240607
# Bump when the output changes: it is part of the cached file name.
FORMAT_VERSION = 1
VOCAB_NAME = "llama-spm"

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 192
CONTEXT_LENGTH = 8192
RMS_EPS = 1e-5
MODEL_NAME = "llmgw-tiny-llama"

# ChatML-like and deliberately plain. Content is used as a string only:
# llama-server's template probe then flattens OpenAI content parts to text
# before rendering, so both content shapes work.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def tiny_model_filename() -> str:
    return f"tiny-llama-v{FORMAT_VERSION}.gguf"


def _read_vocab(vocab: Path) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """The ``tokenizer.*`` key/values of a vocab GGUF, in file order, with their types."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(vocab)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise ValueError(f"{vocab} has no tokenizer.ggml.tokens")
    return out


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], scale: float, dtype) -> np.ndarray:
    # Uniform doubles from PCG64 are the most version-stable numpy stream.
    return ((rng.random(shape) * 2.0 - 1.0) * scale).astype(dtype)


def _write(path: Path, vocab: Path) -> None:
    import gguf

    tok = _read_vocab(vocab)
    fields = {k: v for k, v, *_ in tok}
    n_vocab = len(fields["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    eos = fields.get("tokenizer.ggml.eos_token_id")
    head_dim = N_EMBD // N_HEAD

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(MODEL_NAME)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, val, vtype, sub in tok:
        if key == "tokenizer.chat_template":
            continue  # ours is written below
        w.add_key_value(key, val, vtype, sub)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.Generator(np.random.PCG64(SEED))
    f16, f32 = np.float16, np.float32
    kv_dim = head_dim * N_HEAD_KV

    emb = _uniform(rng, (n_vocab, N_EMBD), 1.0, f16)
    w.add_tensor("token_embd.weight", emb)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=f32))
        w.add_tensor(p + "attn_q.weight", _uniform(rng, (N_EMBD, N_EMBD), 0.2, f16))
        w.add_tensor(p + "attn_k.weight", _uniform(rng, (kv_dim, N_EMBD), 0.2, f16))
        w.add_tensor(p + "attn_v.weight", _uniform(rng, (kv_dim, N_EMBD), 0.2, f16))
        w.add_tensor(p + "attn_output.weight", _uniform(rng, (N_EMBD, N_EMBD), 0.2, f16))
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, dtype=f32))
        w.add_tensor(p + "ffn_gate.weight", _uniform(rng, (N_FF, N_EMBD), 0.2, f16))
        w.add_tensor(p + "ffn_up.weight", _uniform(rng, (N_FF, N_EMBD), 0.2, f16))
        w.add_tensor(p + "ffn_down.weight", _uniform(rng, (N_EMBD, N_FF), 0.2, f16))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=f32))
    out = _uniform(rng, (n_vocab, N_EMBD), 0.5, f16)
    if isinstance(eos, int) and 0 <= eos < n_vocab:
        out[eos] = 0  # logit 0 among ~32k random ones: EOS is (practically) never chosen
    w.add_tensor("output.weight", out)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_model(path: Path | str, vocab: Path | str | None = None) -> Path:
    """Write the tiny model to ``path`` atomically; an identical file is left alone.

    ``vocab`` defaults to the cached ``ggml-vocab-llama-spm.gguf`` (fetched
    from the pinned sdist if needed, without building anything).
    """
    path = Path(path)
    if vocab is None:
        from llmgw.agent.provision.llamacpp_source import vocab_path

        vocab = vocab_path(VOCAB_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    # gguf writes to a path of its own; the bytes then go in place through the one atomic write.
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        built = Path(tmp) / path.name
        _write(built, Path(vocab))
        data = built.read_bytes()
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return path  # identical: keep the existing file (and its mtime)
    write_atomic(path, data)
    return path


def tiny_model_path() -> Path:
    """The cached tiny model (written on first use) under the llmgw cache dir."""
    from llmgw.agent.provision.llamacpp_source import cache_dir

    path = cache_dir() / "models" / tiny_model_filename()
    if not path.is_file():
        write_tiny_model(path)
    return path
