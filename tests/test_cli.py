import json
from pathlib import Path

import pytest

from experiments.cli import main
from tests.conftest import smollm2_path

DATA = Path(__file__).parents[1] / "experiments" / "data"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_on_the_real_model(capsys):
    code, out, _ = run(capsys, "generate", "--model", str(smollm2_path()), "--chat",
                       "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
                       "--json")
    assert code == 0
    result = json.loads(out)
    assert "Paris" in result["text"]
    assert 0 < len(result["tokens"]) <= 12 and result["method"] == "full"


def test_ppl_json_on_real_text(capsys, tmp_path):
    code, out, _ = run(capsys, "ppl", "--model", str(smollm2_path()), "--text",
                       str(DATA / "kjv_genesis.txt"), "--context", "128", "--stride", "64",
                       "--max-tokens", "384", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["tokens_scored"] == 383
    assert 1.5 < result["ppl"] < 100  # a real model on real prose, not a uniform guess (49152)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"], "not found"),
    (["generate", "--model", "{gguf}", "--prompt", "hi", "--method", "nosuch"], "unknown method"),
    (["ppl", "--model", "{gguf}", "--text", "/no/such.txt", "--context", "8"], "text file not found"),
])
def test_bad_input_gives_one_clear_error(capsys, argv, message):
    argv = [a.replace("{gguf}", str(smollm2_path())) for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err
