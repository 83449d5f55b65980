"""The layout holds: imports run one way (config <- model <- decode <- calibrate <- pipeline <- train,
bench <- cli, jobs <- the package's facade), no import circle, config is a leaf that loads no framework, three modules import ray (the processor, the job's data plane
and the light module its tasks run, which loads no torch)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph_tool", ROOT / "tools" / "imports.py")
imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(imports)

LAYERS = ["config", "assets", "model", "decode", "calibrate", "pipeline", "train", "bench", "cli", "jobs", "commands",
          "__main__"]


def layer(module: str) -> int:
    parts = module.split(".")
    # the package itself is the public facade (`from entmtp_ray import build_processor`): above every layer
    return LAYERS.index(parts[1]) if len(parts) > 1 else len(LAYERS)


def test_imports_run_one_way_and_close_no_circle():
    edges = imports.graph(ROOT / "entmtp_ray")
    assert len(edges) > 30  # the tool found the package
    upward = [(m, d) for m, deps in edges.items() for d in deps if layer(d) > layer(m)]
    assert upward == [], f"imports against the layering {LAYERS}: {upward}"
    assert imports.circles(edges) == []


def test_the_tool_finds_a_circle_and_counts_levels(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from .a import x\n")  # a lazy import closes the circle
    (package / "c.py").write_text("import pkg.a\n")
    edges = imports.graph(package)
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"} and edges["pkg.c"] == {"pkg.a"}
    assert imports.circles(edges) == [["pkg.a", "pkg.b"]]
    assert imports.levels(edges)["pkg.c"] == 1


def test_config_is_a_leaf_that_loads_no_framework_and_only_the_ray_stages_import_ray():
    probe = ("import sys, entmtp_ray.config; "
             "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    assert imports.graph(ROOT / "entmtp_ray")["entmtp_ray.config"] == set()
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "entmtp_ray").rglob("*.py")
                   if any(line.strip().startswith(("import ray", "from ray")) for line in p.read_text().splitlines()))
    assert users == ["entmtp_ray/pipeline/dataplane.py", "entmtp_ray/pipeline/processor.py",
                     "entmtp_ray/pipeline/streams.py"]


def test_the_jobs_read_tasks_and_small_actors_load_no_torch():
    """Ray imports a task's module in its worker: the read tasks, scans, the job's ledger, --n's expansion and the
    summary must not pay for torch and transformers while the first actor loads them on the same cores (issue 50),
    at import or when they run (a read task's lazy import of the output schema once pulled torch: 2.3 s)."""
    probe = ("import sys, pyarrow as pa\n"
             "from entmtp_ray.config import DecodingConfig\n"
             "from entmtp_ray.pipeline import streams, outputs\n"
             "from entmtp_ray.pipeline.sampling import expand\n"
             "from entmtp_ray.pipeline.tasks import prompt_spec, standardize\n"
             "spec = prompt_spec('humaneval', None, None, None, None, None)\n"
             "rows = standardize(pa.table({'task_id': ['a'], 'prompt': ['def f(): pass']}), spec)\n"
             "expand(rows, DecodingConfig(n=2))\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_read_beside_the_checkout_is_refused_and_recorded(tmp_path):
    """helpers/alone.py, the suite's guard: a folder beside the checkout is a neighbour, the checkout's own files,
    the temp dir's and this Python's are not; an open() of a neighbour's file fails and is recorded."""
    from helpers import alone

    clone, beside = tmp_path / "clone", tmp_path / "shared"
    (clone / "data").mkdir(parents=True)
    beside.mkdir()
    (beside / "calibration.jsonl").write_text("{}\n")
    (clone / "data" / "ok.jsonl").write_text("{}\n")
    assert alone.neighbours(clone) == (str(beside.resolve()) + "/",)
    assert alone.install(clone) == (str(beside.resolve()) + "/",)
    assert (clone / "data" / "ok.jsonl").read_text() == "{}\n"
    try:
        (beside / "calibration.jsonl").read_text()
    except PermissionError as exc:
        assert "lies beside the checkout" in str(exc)
    else:
        raise AssertionError("a read beside the checkout was not refused")
    assert alone.READ.pop() == str((beside / "calibration.jsonl").resolve())  # popped: the run itself is clean

def test_the_jobs_driver_loads_no_model_code():
    """The driver plans and checks the job while its first actor imports the model on the other core: transformers'
    Llama modelling (3 s of imports on 2 cores: torch._dynamo, torch.distributed.tensor) is the actors' alone."""
    probe = ("import sys, entmtp_ray.jobs.generate, entmtp_ray.cli\n"
             "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m\n"
             "             or m in ('torch._dynamo', 'torch.distributed.tensor', 'transformers.core_model_loading')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_actors_engine_loads_and_decodes_without_transformers_modelling():
    """A job's actor loads the model into layers.py's containers: transformers' modelling stack (torch._dynamo,
    torch.distributed.tensor: 3 s of imports on 2 cores) stays out of the first row's way (issue 50)."""
    probe = ("import sys\n"
             "from entmtp_ray.config import DecodingConfig, ModelConfig\n"
             "from entmtp_ray.pipeline.assemble import resolve\n"
             "from entmtp_ray.pipeline.engine import Engine\n"
             "plan = resolve(ModelConfig(), DecodingConfig(task='humaneval', max_new_tokens=4))\n"
             "engine = Engine(ModelConfig(), plan, transformers_forward=False)\n"
             "engine.warm_up()\n"
             "print(sorted(m for m in ('transformers.models.llama.modeling_llama', 'torch._dynamo', "
             "'torch.distributed.tensor', 'transformers.core_model_loading') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]
