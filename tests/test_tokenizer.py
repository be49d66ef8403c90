import pytest

from gptoss_jax import tokenizer


def test_o200k_harmony_from_shared_folder():
    enc = tokenizer.load()
    assert enc.n_vocab == 201088
    ids = enc.encode("Hello, world!")
    assert enc.decode(ids) == "Hello, world!"
    specials = {
        "<|return|>": 200002,
        "<|constrain|>": 200003,
        "<|channel|>": 200005,
        "<|start|>": 200006,
        "<|end|>": 200007,
        "<|message|>": 200008,
        "<|call|>": 200012,
        "<|endoftext|>": 199999,
        "<|startoftext|>": 199998,
    }
    for text, i in specials.items():
        assert enc.encode(text, allowed_special="all") == [i]
    assert enc.encode("<|start|>assistant", allowed_special="all")[:1] == [200006]


def test_explicit_path_and_checkpoint_folder(tmp_path, monkeypatch):
    import shutil

    src = tokenizer._candidates(None, None)[0]
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    shutil.copy(src, tmp_path / tokenizer.RANK_FILE)
    assert tokenizer.load(checkpoint=tmp_path).n_vocab == 201088
    assert tokenizer.load(path=tmp_path / tokenizer.RANK_FILE).n_vocab == 201088


def test_missing_vocab_says_how_to_fix(tmp_path, monkeypatch):
    with pytest.raises(tokenizer.TokenizerError, match="not found"):
        tokenizer.load(path=tmp_path / "nothing.tiktoken")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    # no local file anywhere and no network: the download fails, the message says what to do
    monkeypatch.setattr("tiktoken.load.read_file", lambda p: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(tokenizer.TokenizerError, match="TIKTOKEN_ENCODINGS_BASE"):
        tokenizer.load()


def test_corrupt_vocab_rejected_by_hash(tmp_path):
    (tmp_path / tokenizer.RANK_FILE).write_text("aGVsbG8= 0\n")
    with pytest.raises(tokenizer.TokenizerError):
        tokenizer.load(path=tmp_path)
