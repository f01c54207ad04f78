"""A coordinator loads no torch: its modules, the worker classes it starts actors from, its
model's configuration and tokenizer, a grammar compiled at the door and its predict app leave
torch to the workers (about 200 MiB of each coordinator's memory; docs/performance/memory.md).
Run in a fresh interpreter, so that nothing this test process imported counts. (The very first
start on a machine reads a GGUF's configuration and tokenizer into a cache folder once, with
transformers' GGUF support, which loads torch; the test makes that folder first, as every later
start finds it.)"""

from __future__ import annotations

import subprocess
import sys

from engine.model.model_files import resolve_model_dir

LEAN = """
import sys
from coordinator.config.loader import defaults
from coordinator.served_model import served_models
from coordinator import cli, server
from coordinator.pool import fleet
from engine.constraint import Constraint

served = served_models(defaults())
model = served.generation
model.grammar_cache().compile(Constraint("regex", "[a-z]{2,5}"))
ids = model.tokenizer.apply_chat_template(
    [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True
)
assert ids, "the chat template rendered nothing"
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print(len(loaded), loaded[:3])
"""


def test_a_coordinator_serves_its_model_without_loading_torch():
    resolve_model_dir("bundled")  # the bundled GGUF's metadata folder, made once per machine
    result = subprocess.run(
        [sys.executable, "-c", LEAN], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "0 []", result.stdout
