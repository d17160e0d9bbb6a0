"""Unit tests for the tiny GGUF writer, with a small synthetic vocabulary."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from llmgw.agent.provision import llamacpp_source
from llmgw.up import tiny_model as tm

N_VOCAB = 300


@pytest.fixture
def vocab(tmp_path) -> Path:
    """A vocab-only GGUF shaped like the sdist's (no tensors), with merges too."""
    path = tmp_path / "ggml-vocab-test.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("vocab-test")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"tok{i}" for i in range(N_VOCAB)])
    w.add_token_scores([float(-i) for i in range(N_VOCAB)])
    w.add_token_types([2, 3, 3] + [1] * (N_VOCAB - 3))
    w.add_token_merges(["t o", "to k"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template("{{ 'theirs' }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _field(r: gguf.GGUFReader, key: str):
    return r.fields[key].contents()


def test_writes_a_llama_gguf_with_copied_vocab(tmp_path, vocab):
    out = tm.write_tiny_model(tmp_path / "m" / "tiny.gguf", vocab=vocab)
    r = gguf.GGUFReader(out)
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "llama.context_length") == 8192
    assert _field(r, "llama.embedding_length") == tm.N_EMBD
    assert _field(r, "llama.block_count") == tm.N_LAYER
    assert _field(r, "llama.attention.head_count") == tm.N_HEAD
    assert _field(r, "llama.rope.dimension_count") == tm.N_EMBD // tm.N_HEAD
    assert _field(r, "llama.vocab_size") == N_VOCAB

    src = gguf.GGUFReader(vocab)
    for key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.add_bos_token",
    ):
        assert _field(r, key) == _field(src, key), key
        assert r.fields[key].types == src.fields[key].types, key
    # Our chat template replaces whatever the vocab file had.
    assert _field(r, "tokenizer.chat_template") == tm.CHAT_TEMPLATE

    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 3 + 9 * tm.N_LAYER
    emb = tensors["token_embd.weight"]
    assert list(emb.shape) == [tm.N_EMBD, N_VOCAB]  # ggml order: ne0 = n_embd
    out_w = np.asarray(tensors["output.weight"].data).reshape(N_VOCAB, tm.N_EMBD)
    assert not out_w[2].any()  # EOS row zeroed
    assert out_w[3].any()
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.1.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.F16


def test_deterministic_and_skips_identical(tmp_path, vocab):
    a = tm.write_tiny_model(tmp_path / "a.gguf", vocab=vocab)
    b = tm.write_tiny_model(tmp_path / "b.gguf", vocab=vocab)
    assert a.read_bytes() == b.read_bytes()

    os.utime(a, (1_000_000, 1_000_000))
    ino = a.stat().st_ino
    tm.write_tiny_model(a, vocab=vocab)
    assert a.stat().st_mtime == 1_000_000 and a.stat().st_ino == ino  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", vocab.name]


def test_rewrites_a_different_file(tmp_path, vocab):
    p = tmp_path / "tiny.gguf"
    p.write_bytes(b"stale")
    tm.write_tiny_model(p, vocab=vocab)
    assert p.read_bytes()[:4] == b"GGUF"
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []


def test_failed_write_leaves_nothing(tmp_path):
    bad = tmp_path / "not-a-vocab.gguf"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError):  # gguf's reader: "GGUF magic invalid"
        tm.write_tiny_model(tmp_path / "out" / "tiny.gguf", vocab=bad)
    assert list((tmp_path / "out").iterdir()) == []


def test_tiny_model_path_uses_cache_and_vocab_path(tmp_path, vocab, monkeypatch):
    monkeypatch.setenv("LLMGW_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(llamacpp_source, "vocab_path", lambda name="llama-spm": calls.append(name) or vocab)
    p = tm.tiny_model_path()
    assert p == tmp_path / "cache" / "models" / tm.tiny_model_filename()
    assert p.read_bytes()[:4] == b"GGUF"
    assert calls == ["llama-spm"]
    assert tm.tiny_model_path() == p and calls == ["llama-spm"]  # cached: no second write


def test_chat_template_renders():
    import jinja2  # declared in the test extra: a missing one is a failure, not a skip

    tpl = jinja2.Environment().from_string(tm.CHAT_TEMPLATE)
    text = tpl.render(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
        ],
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_real_vocab_size_if_cached():
    real = llamacpp_source.vocab_dir() / llamacpp_source.vocab_filename(tm.VOCAB_NAME)
    if not real.is_file():
        pytest.skip("real vocab not cached (scripts/build-llama-server caches it)")
    r = gguf.GGUFReader(real)
    n = len(r.fields["tokenizer.ggml.tokens"].data)
    # Two f16 [n_vocab, n_embd] matrices dominate: a few MB, well under 20 MB.
    assert 2 * n * tm.N_EMBD * 2 < 20_000_000
