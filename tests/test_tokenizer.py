from pathlib import Path

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

    src = tokenizer.rank_file()
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("GPTOSS_JAX_HOME", str(tmp_path / "home"))
    shutil.copy(src, tmp_path / tokenizer.RANK_FILE)
    assert tokenizer.load(checkpoint=tmp_path).n_vocab == 201088
    assert tokenizer.load(path=tmp_path / tokenizer.RANK_FILE).n_vocab == 201088


def test_missing_vocab_says_how_to_fix(tmp_path, monkeypatch):
    with pytest.raises(tokenizer.TokenizerError, match="not found"):
        tokenizer.load(path=tmp_path / "nothing.tiktoken")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPTOSS_JAX_HOME", str(tmp_path / "home"))
    # no local file anywhere and no network: the download fails, one message gives the lookup order
    monkeypatch.setattr("tiktoken.load.read_file", lambda p: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer.load()
    msg = str(e.value)
    assert "Lookup order: --tokenizer PATH" in msg and "TIKTOKEN_ENCODINGS_BASE" in msg and "offline" in msg
    assert str(tmp_path / tokenizer.RANK_FILE) in msg


def test_download_when_nothing_is_local(tmp_path, monkeypatch):
    """Online and with no local file, tiktoken's download fetches it (hash checked) and it is kept for next time."""
    data = tokenizer.rank_file().read_bytes()
    fetched = []
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPTOSS_JAX_HOME", str(tmp_path / "home"))

    def read_file(where):  # the network, for URLs; local files as usual
        if not where.startswith("https://"):
            return Path(where).read_bytes()
        fetched.append(where)
        return data

    monkeypatch.setattr("tiktoken.load.read_file", read_file)
    assert tokenizer.load().n_vocab == 201088 and fetched == [tokenizer.RANK_URL]
    assert tokenizer.rank_file() == tmp_path / "home" / "tokenizer" / tokenizer.RANK_FILE
    assert tokenizer.load().n_vocab == 201088 and len(fetched) == 1  # the kept copy, no second download


def test_harmony_reads_the_given_rank_file_without_the_env_var(tmp_path):
    """`serve --tokenizer PATH` reaches openai-harmony too (it reads only $TIKTOKEN_ENCODINGS_BASE), whatever the
    file is called; a fresh process, since the encoding is loaded once per process."""
    import os
    import subprocess
    import sys

    renamed = tmp_path / "vocab.tiktoken"
    renamed.write_bytes(tokenizer.rank_file().read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}
    env.update(GPTOSS_JAX_HOME=str(tmp_path / "home"), TIKTOKEN_CACHE_DIR=str(tmp_path / "none"))
    code = (
        "import os, sys; from gptoss_jax import harmony; e = harmony.load_encoding(sys.argv[1]); "
        "print(len(e.encode('Hello, world!', allowed_special='all')), os.environ.get('TIKTOKEN_ENCODINGS_BASE'))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(renamed)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "None"]


def test_corrupt_vocab_rejected_by_hash(tmp_path):
    (tmp_path / tokenizer.RANK_FILE).write_text("aGVsbG8= 0\n")
    with pytest.raises(tokenizer.TokenizerError):
        tokenizer.load(path=tmp_path)
