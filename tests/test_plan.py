"""`python -m eformer_nb.plan` (issue 47) in a subprocess: the plan printed, exit status 0 when it fits, 1 when it
does not (with the changes that make it fit), 2 on bad input with the value and the valid choices named."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eformer_nb.plan", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_fits():
    r = plan_cli("--model", "tinyllama", "--mesh", "dp:1,fsdp:8,tp:1", "--batch", "8", "--seq-len", "2048",
                 "--device", "h100-80gb", "--train")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "**tinyllama**, train, batch 8 x 2048 tokens on mesh fsdp:8: fits" in r.stdout
    assert "| optimizer state |" in r.stdout


def test_does_not_fit_and_says_what_to_change():
    r = plan_cli("--model", "llama3-8b", "--mesh", "fsdp:8", "--batch", "8", "--seq-len", "4096",
                 "--device", "h100-80gb")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "does NOT fit" in r.stdout and "fits with gradient_checkpointing=nothing_saveable" in r.stdout


def test_decode_and_divisibility_problem():
    r = plan_cli("--model", "smollm2", "--mesh", "tp:2", "--batch", "4", "--seq-len", "8192", "--device", "tpu-v5e",
                 "--decode", "--dtype", "bfloat16", "--param-dtype", "bfloat16")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "decode" in r.stdout and "num_attention_heads 9 is not divisible by tp=2: use tp in [1, 3, 9]" in r.stdout


def test_bad_input_names_the_value_and_the_choices():
    r = plan_cli("--model", "llama-9000", "--mesh", "fsdp:8", "--batch", "8", "--seq-len", "128", "--device", "h200")
    assert r.returncode == 2 and "model 'llama-9000'" in r.stderr and "'tinyllama'" in r.stderr, r.stderr
    r = plan_cli("--model", "tiny", "--mesh", "fsdp:4", "--batch", "8", "--seq-len", "128", "--device", "h200",
                 "--devices", "8")
    assert r.returncode == 2 and "spans 4 devices, but the plan is for 8" in r.stderr, r.stderr
