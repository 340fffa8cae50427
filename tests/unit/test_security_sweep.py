"""The inputs sweep of docs/security.md: what the package's source may not call (read with ``ast``), tracking
credentials kept out of the config and the logs, and owner-only run directories."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from megatron_gtpo.config import dump_resolved, load_config
from megatron_gtpo.tracking.uri import check_tracking_uri, redact_uri
from megatron_gtpo.utils.configuration import ConfigError
from megatron_gtpo.utils.secret import private_directory
from tests.helpers import REPO

FILES = sorted((REPO / "megatron_gtpo").rglob("*.py"))

# torch's object collectives: they pickle on one rank and unpickle what a peer's gloo/NCCL socket
# delivers (issue #34, S5); the package's control plane carries data (parallel/control.py, objects.py)
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")

ALLOWED = {
    # eval of an expression the module itself generates from digits and + - * (never input), with no builtins
    ("megatron_gtpo/data/arithmetic.py", "eval"),
    # the guarded unpickler of torch's object collectives: it subclasses pickle.Unpickler to refuse code
    ("megatron_gtpo/parallel/unpickle.py", "pickle"),
}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def findings(path: Path, root: Path = REPO) -> list[tuple[str, str, int]]:
    """(file, what, line) of every call or import the package must not make."""
    rel, out = str(path.relative_to(root)), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            safe_torch_load = isinstance(keywords.get("weights_only"), ast.Constant) and \
                keywords["weights_only"].value is True
            if name in ("pickle.load", "pickle.loads", "yaml.load", "yaml.unsafe_load", "yaml.full_load",
                        "eval", "exec", "marshal.loads") or (name == "torch.load" and not safe_torch_load):
                out.append((rel, name, node.lineno))
            elif name.rsplit(".", 1)[-1] in OBJECT_COLLECTIVES:
                out.append((rel, name, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.distributed"):
            out += [(rel, f"{node.module}.{a.name}", node.lineno) for a in node.names if a.name in OBJECT_COLLECTIVES]
        elif isinstance(node, ast.ImportFrom) and node.module in ("multiprocessing.connection", "pickle", "yaml"):
            out += [(rel, f"{node.module}.{a.name}", node.lineno) for a in node.names
                    if a.name in ("Listener", "Client", "load", "loads", "unsafe_load", "full_load", "Loader")]
        elif isinstance(node, ast.Import):
            out += [(rel, a.name, node.lineno) for a in node.names if a.name in ("pickle", "cloudpickle", "dill")]
    return [f for f in out if (f[0], f[1]) not in ALLOWED]


def test_security_the_package_never_unpickles_evals_or_loads_unsafe_yaml():
    """Nor calls torch's object collectives (injected: control.broadcast_data back on
    dist.broadcast_object_list -> parallel/control.py is listed, the test fails)."""
    assert [f for path in FILES for f in findings(path)] == []


def test_security_the_sweep_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"  # the negative control of the check above
    bad.write_text("import pickle\nimport torch, yaml\nfrom multiprocessing.connection import Listener\n"
                   "torch.load('x')\ntorch.load('x', weights_only=False)\ntorch.load('x', weights_only=True)\n"
                   "yaml.load(s)\npickle.loads(b)\ndist.all_gather_object(out, x)\n"
                   "from torch.distributed import broadcast_object_list\ntorch.distributed.gather_object(x)\n")
    names = sorted(what for _, what, _ in findings(bad, root=tmp_path))
    assert names == sorted(["pickle", "multiprocessing.connection.Listener", "torch.load", "torch.load", "yaml.load",
                            "pickle.loads", "dist.all_gather_object",
                            "torch.distributed.broadcast_object_list", "torch.distributed.gather_object"])
    # weights_only=True is the one torch.load allowed


def _torchrun_lines(text: str) -> list[str]:
    """The torchrun commands of a shell script, continuation lines joined, comments dropped."""
    joined = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")).replace("\\\n", " ")
    return [line for line in joined.splitlines() if "torch.distributed.run" in line]


def test_security_every_launcher_uses_torchruns_static_rendezvous():
    """torchrun's c10d (and etcd) rendezvous pickle their state into the store and unpickle what they
    read back (docs/security.md): every script that starts torchrun asks for the static backend.
    Injected: `--rdzv-backend=c10d` back in slurm/train.sbatch -> this test fails (its negative
    control below checks the same parse on such a line)."""
    scripts = [*sorted((REPO / "slurm").glob("*.sbatch")), *sorted((REPO / "launch").glob("*.sh"))]
    found = {path.name: _torchrun_lines(path.read_text()) for path in scripts}
    assert found["train.sbatch"] and found["torchrun_node.sh"], found  # the parse sees both launches
    for name, lines in found.items():
        for line in lines:
            backends = [w.split("=", 1)[1].strip("'\"") for w in line.split()
                        if w.startswith(("--rdzv-backend=", "--rdzv_backend="))]
            assert backends == ["static"], (name, line)
    bad = 'srun x \\\n  "$P" -m torch.distributed.run --nnodes=2 \\\n  --rdzv-backend=c10d --rdzv-endpoint=h:1\n'
    [line] = _torchrun_lines(bad)
    assert "--rdzv-backend=c10d" in line.split()


def test_security_tracking_uri_with_a_password_is_refused_and_uris_are_redacted(tmp_path):
    with pytest.raises(ConfigError, match=r"tracking.uri='https://bob:\*\*\*@mlflow.example' holds a password") as err:
        load_config(REPO / "configs" / "tiny.yaml", ["tracking.uri=https://bob:s3cret@mlflow.example"])
    assert "s3cret" not in str(err.value)
    assert redact_uri("postgresql://bob:s3cret@db:5432/ml") == "postgresql://bob:***@db:5432/ml"
    assert redact_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    with pytest.raises(ConfigError) as err:  # an error about an unreachable store does not show it either
        check_tracking_uri("http://bob:s3cret@127.0.0.1:9/", timeout_s=2)
    assert "s3cret" not in str(err.value) and "bob:***@" in str(err.value)
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"output_dir={tmp_path / 'run'}"])
    assert "s3cret" not in dump_resolved(cfg).read_text()


def test_security_run_directories_are_owner_only(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"output_dir={tmp_path / 'runs' / 'a'}"])
    written = dump_resolved(cfg)
    assert written.parent.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    assert private_directory(shared) == 0o755 and shared.stat().st_mode & 0o777 == 0o700
    assert private_directory(shared) is None  # already private: nothing to do


def test_security_a_run_directory_of_another_user_is_refused(tmp_path):
    """A run or checkpoint directory made beforehand by another user (e.g. under /tmp) was accepted
    silently, and its owner could then read or replace the checkpoints (injected: the owner check
    dropped -> the directory is used, the test fails). As root: a directory given to uid 65534;
    otherwise: a directory of root's."""
    if os.geteuid() == 0:
        theirs, owner = tmp_path / "theirs", 65534
        theirs.mkdir(mode=0o777)
        os.chown(theirs, owner, owner)
    else:
        theirs, owner = Path("/usr"), 0
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"output_dir={theirs}"])
    with pytest.raises(PermissionError, match=rf"belongs to uid {owner}.*--output-dir"):
        dump_resolved(cfg)
    with pytest.raises(PermissionError, match=f"belongs to uid {owner}"):
        private_directory(theirs / ".." / theirs.name)
    assert not (theirs / "config.yaml").exists()
