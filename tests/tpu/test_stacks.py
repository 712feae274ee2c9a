"""describe() and setup() on the stacks people have (2026): Colab's TPU runtime (torch 2.9 + torch_xla
2.9, no gcsfs), a torch newer than torch_xla's last release (2.9), Colab's GPU runtime (torch 2.11, no
torch_xla), and TorchTPU (``torch_tpu``, torch_xla's successor). Installed versions are faked, so these
run on any stack, with or without torch_xla."""

import importlib
import re
import shlex
import subprocess

import pytest

from nbkit import tpu
from nbkit.tpu import runtime
from tpu_fakes import COLAB, fake_root

setup_py = importlib.import_module("nbkit.tpu.setup")  # nbkit.tpu.setup is the function


@pytest.fixture
def stack(monkeypatch, tmp_path):
    """``stack(torch=..., **{"torch_xla": "2.9.0", "gcsfs": None, ...})`` makes describe()/setup() see
    those versions (a name left out keeps its real version; None: not installed)."""

    def install(torch_version, **versions):
        real = runtime.dist_version
        versions.setdefault("torch", torch_version.split("+")[0])

        def fake(name):
            key = name.replace("-", "_")
            return versions[key] if key in versions else real(name)

        monkeypatch.setattr(runtime.torch, "__version__", torch_version)
        monkeypatch.setattr(runtime, "dist_version", fake)
        monkeypatch.setattr(setup_py, "dist_version", fake)
        if "torch_tpu" not in versions:  # a real torch_tpu never is installed here; find_spec must not see one
            monkeypatch.setattr(runtime, "torch_tpu_version", lambda: None)
        else:
            monkeypatch.setattr(runtime, "torch_tpu_version", lambda: versions["torch_tpu"])
        libtpu = tmp_path / "libtpu.so"
        libtpu.write_bytes(b"\x7fELF")
        return {"TPU_LIBRARY_PATH": str(libtpu)}

    return install


def colab_tpu_root(tmp_path):
    return fake_root(tmp_path, tpu_pci=["0x0063"], dirs=["content"])


def everything(report) -> str:
    return "\n".join([str(report), str(report.info), " ".join(report.pip_command or [])])


def test_colab_tpu_runtime_installs_only_gcsfs(stack, tmp_path):
    """Colab's TPU runtime: torch 2.9.0+cpu, torch_xla 2.9.0 with its libtpu, ipywidgets 7.7.1, no gcsfs."""
    env = {**COLAB, "TPU_ACCELERATOR_TYPE": "v5litepod-1",
           **stack("2.9.0+cpu", torch_xla="2.9.0", gcsfs=None, ipywidgets="7.7.1", matplotlib="3.10.0")}
    report = tpu.setup(dry_run=True, environ=env, root=colab_tpu_root(tmp_path))
    assert report.info.kind == "colab-tpu" and not report.info.warnings
    assert report.missing == ("gcsfs>=2023.1",)
    assert report.pip_command[-1:] == ["gcsfs>=2023.1"] and not any("torch" in a for a in report.pip_command[4:])
    facts = next(m for m in report.messages if m.startswith("Colab's TPU runtime"))
    assert "Python 3.13" in facts and "torch 2.9 with torch_xla 2.9" in facts and "ipywidgets 7.7.1" in facts
    assert "not gcsfs" in facts
    assert "3.12" not in everything(report)


def test_colab_tpu_with_gcsfs_installs_nothing(stack, tmp_path):
    env = {**COLAB, **stack("2.9.0+cpu", torch_xla="2.9.0", gcsfs="2026.10.1", ipywidgets="7.7.1", matplotlib="3.10.0")}
    report = tpu.setup(dry_run=True, install=True, environ=env, root=colab_tpu_root(tmp_path))
    assert (report.missing, report.pip_command, report.installed) == ((), None, False)


def test_torch_past_xla_on_a_tpu_never_asks_for_a_newer_torch_xla(stack, tmp_path):
    """Someone upgraded torch on the TPU runtime: torch_xla 2.9 is the last; on torch_xla the fix is torch 2.9,
    never torch_xla 2.14, and by default setup() takes TorchTPU, which runs on that torch."""
    env = {**COLAB, **stack("2.14.1+cpu", torch_xla="2.9.0", torch_tpu=None, gcsfs="2026.10.1")}
    auto = tpu.setup(dry_run=True, environ=dict(env), root=colab_tpu_root(tmp_path / "auto"))
    assert auto.stack == "torch_tpu" and auto.missing == ("torch-tpu",) and auto.torch_command is None
    assert auto.pip_command[-1] == "torch-tpu" and not any("torch_xla" in r for r in auto.requirements)
    report = tpu.setup(dry_run=True, environ=env, root=colab_tpu_root(tmp_path), stack="torch_xla")
    text = everything(report)
    assert not re.search(r"torch_xla(\[tpu\])?~=2\.1[0-9]", text) and "torch==2.14" not in text
    warning = next(w for w in report.info.warnings if "newer than torch_xla" in w)
    assert "pip install 'torch_xla[tpu]~=2.9.0' 'torch==2.9.0' 'torchvision==0.24.0'" in warning
    assert "do not upgrade torch past 2.9" in warning
    assert "torch==2.9.0" in report.requirements and "torch_xla[tpu]~=2.9.0" in report.requirements


def test_torch_past_xla_on_a_tpu_without_torch_xla_says_it_installs_torch_2_9(stack, tmp_path):
    env = {**COLAB, **stack("2.15.0", torch_xla=None, torch_tpu=None, torchvision="0.29.2", gcsfs="2026.10.1")}
    report = tpu.setup(dry_run=True, environ=env, root=colab_tpu_root(tmp_path), stack="torch_xla")
    assert report.missing[:3] == ("torch_xla[tpu]~=2.9.0", "torch==2.9.0", "torchvision==0.24.0")
    warning = next(w for w in report.info.warnings if w.startswith("torch_xla is not installed"))
    assert "installs torch 2.9 in place of 2.15.0" in warning and "do not upgrade torch there" in warning
    assert any("newer than torch_xla's last release (2.9)" in m for m in report.messages)


def test_colab_gpu_runtime_with_torch_2_11_needs_no_torch_xla(stack, tmp_path):
    """Colab's GPU and CPU runtimes run torch 2.11: no torch_xla exists for it, and nothing asks for one."""
    env = {**COLAB, "COLAB_GPU": "1", **stack("2.11.0+cu128", torch_xla=None, gcsfs="2026.10.1")}
    report = tpu.setup(environ=env, root=fake_root(tmp_path, gpus=["Tesla T4"]))
    assert report.info.kind == "gpu"
    assert not any(r.startswith(("torch_xla", "torch==")) for r in report.requirements)
    assert report.missing == () and report.verified is None and report.ok
    assert any("train on torch.device('cuda')" in m for m in report.messages)
    assert any(m.startswith("device check skipped: no torch_xla for torch 2.11.0") for m in report.messages)
    assert any("has no torch_xla" in n for n in report.info.notes)
    assert "2.11" not in " ".join(report.pip_command or [])


def test_torch_tpu_installed_is_described_with_its_device_and_untested_status(stack, tmp_path):
    env = {**COLAB, **stack("2.15.0", torch_xla=None, torch_tpu="0.1.0", gcsfs="2026.10.1")}
    report = tpu.setup(dry_run=True, environ=env, root=colab_tpu_root(tmp_path))
    info = report.info
    assert info.torch_tpu == "0.1.0" and ("torch_tpu (TorchTPU)", "0.1.0") in info.rows()
    note = next(n for n in info.notes if n.startswith("TorchTPU (torch_tpu 0.1.0, needs torch ") and "is installed" in n)
    assert "ds.loader(batch_size, device='tpu')" in note and "untested on real TPU hardware" in note
    assert note in str(info) and "TorchTPU" in info._repr_html_()
    # TorchTPU runs on the new torch: setup() must not pull torch back to 2.9 for torch_xla.
    assert not any(r.startswith(("torch_xla", "torch==")) for r in report.requirements)
    assert note in report.messages and not info.warnings


def test_no_document_says_colab_runs_python_3_12():
    from tpu_fakes import REPO

    docs = [REPO / "README.md", REPO / "Makefile", REPO / ".ci" / "run", *sorted((REPO / "notebooks").glob("*.ipynb")),
            *sorted((REPO / "nbkit" / "tpu").glob("*.py"))]
    for path in docs:
        text = path.read_text()
        assert not re.search(r"Colab[^.\n]{0,40}(Python )?3\.12", text), path


def test_colab_tpu_moved_to_torch_tpu_gets_pytorch_orgs_install(stack, tmp_path):
    """Colab's TPU runtime (torch 2.9 + torch_xla 2.9), setup(stack='torch_tpu'): a CPU torch TorchTPU
    supports from pytorch.org's index, then torch-tpu; never torch_xla."""
    env = {**COLAB, **stack("2.9.0+cpu", torch_xla="2.9.0", torch_tpu=None, gcsfs="2026.10.1",
                            ipywidgets="7.7.1", matplotlib="3.10.0")}
    report = tpu.setup(dry_run=True, environ=env, root=colab_tpu_root(tmp_path), stack="torch_tpu")
    spec = tpu.torchtpu.torch_specifier()
    assert report.missing == (f"torch{spec}", "torch-tpu")
    assert report.torch_command[4:] == [f"torch{spec}", "torchvision", "--index-url", "https://download.pytorch.org/whl/cpu", "--upgrade"]
    assert report.pip_command[4:] == ["torch-tpu"] and not any("torch_xla" in r for r in report.requirements)
    assert " && " in dict(report.rows())["pip command"]
    with pytest.raises(ValueError, match=r"setup\(stack='jax'\): choose one of 'auto', 'torch_xla', 'torch_tpu'"):
        tpu.setup(dry_run=True, environ=env, stack="jax")


def _shell_words(command: str) -> list:
    """``command`` as a POSIX shell splits it; a ``>`` or ``<`` left unquoted would be a redirection."""
    words = shlex.split(command)
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    assert not {"<", ">", ">=", "<=", "<<", ">>"} & set(lexer), f"unquoted redirection in {command!r}"
    return words


def test_every_command_shown_is_quoted_for_a_shell(stack, tmp_path):
    """Colab's TPU runtime moved to TorchTPU: the table's pip command, the missing-packages message and
    describe()'s warning each paste into a shell (or a ``!`` cell) as the very commands setup() runs."""
    env = {**COLAB, **stack("2.9.0+cpu", torch_xla="2.9.0", torch_tpu=None, gcsfs=None,
                            ipywidgets="7.7.1", matplotlib="3.10.0")}
    report = tpu.setup(dry_run=True, environ=env, root=colab_tpu_root(tmp_path), stack="torch_tpu")
    spec = tpu.torchtpu.torch_specifier()
    assert report.torch_command[4] == f"torch{spec}" and ">" in spec  # the case that needs quotes
    row = dict(report.rows())["pip command"]
    assert _shell_words(row) == [*report.torch_command, "&&", *report.pip_command]
    message = next(m for m in report.messages if m.startswith("missing: "))
    pasted = message.split(" or: ", 1)[1]
    assert _shell_words(pasted) == ["pip", "install", *report.torch_command[4:], "&&", "pip", "install",
                                    *report.pip_command[4:]]
    assert subprocess.run(["sh", "-n", "-c", pasted]).returncode == 0
    # describe()'s advice when torch_tpu is installed on a torch it does not support
    env = {**COLAB, **stack("2.9.0+cpu", torch_xla=None, torch_tpu="0.2.0", gcsfs="2026.10.1")}
    info = tpu.describe(environ=env, root=colab_tpu_root(tmp_path / "installed"))
    warning = next(w for w in info.warnings if w.startswith("torch_tpu 0.2.0 needs"))
    pasted = warning.split(" or: ", 1)[1].removesuffix(", then restart the runtime")
    assert _shell_words(pasted)[:3] == ["pip", "install", f"torch{spec}"]
    assert runtime.shell_command(["/a b/python", "-m", "pip", "install", "it's"]) == "'/a b/python' -m pip install 'it'\"'\"'s'"


def test_torch_tpu_on_a_tpu_vm_without_libtpu_never_advises_torch_xla(stack, tmp_path):
    """A Cloud TPU VM with torch 2.9 and neither torch_xla nor libtpu: setup(stack='torch_tpu') advises
    TorchTPU's install only (describe()'s torch_xla command would pin torch back to 2.9); the torch_xla
    stack still gets its own."""
    stack("2.9.0+cpu", torch_xla=None, libtpu=None, libtpu_nightly=None, torch_tpu=None, gcsfs="2026.10.1")
    env = {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_SKIP_MDS_QUERY": "1"}
    report = tpu.setup(dry_run=True, environ=dict(env), root=fake_root(tmp_path), stack="torch_tpu")
    assert report.info.kind == "tpu-vm" and report.info.stack == "torch_tpu" and report.stack == "torch_tpu"
    text = everything(report)
    assert "pip install 'torch_xla" not in text and "torch==2.9.0" not in text and "torch_xla[tpu]" not in text
    warning = next(w for w in report.info.warnings if w.startswith("TorchTPU (torch-tpu"))
    assert "setup(stack='torch_tpu', install=True)" in warning and "pip install 'torch-tpu'" in warning
    xla = tpu.setup(dry_run=True, environ=dict(env), root=fake_root(tmp_path / "xla"), stack="auto")
    assert xla.stack == "torch_xla" and any("pip install 'torch_xla[tpu]~=2.9.0'" in w for w in xla.info.warnings)
    with pytest.raises(ValueError, match=r"stack='jax': choose one of"):
        tpu.describe(environ={}, root="/nonexistent", stack="jax")


def _broken_torch_tpu(tmp_path) -> str:
    """A torch_tpu that is installed but does not import (as on a torch it does not support, or without its libtpu)."""
    package = tmp_path / "broken" / "torch_tpu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("libtpu.so: cannot open shared object file")\n')
    return str(package.parent)


def test_a_torch_tpu_that_does_not_import_gives_a_report_naming_the_fix(stack, tmp_path, monkeypatch):
    path = _broken_torch_tpu(tmp_path)
    monkeypatch.syspath_prepend(path)  # found (not imported) by setup(); the check's subprocess gets PYTHONPATH
    monkeypatch.setattr(tpu.torchtpu, "version", lambda: "0.2.0")
    # On a torch it does not support: no check to run, the report names the torch range and the commands.
    env = {**COLAB, "PYTHONPATH": path, **stack("2.9.0+cpu", torch_xla=None, torch_tpu="0.2.0", gcsfs="2026.10.1",
                                                ipywidgets="7.7.1", matplotlib="3.10.0")}
    report = tpu.setup(environ=env, root=colab_tpu_root(tmp_path / "old"))
    assert report.stack == "torch_tpu" and report.pip_command is None and report.torch_command
    assert report.verified is False and not report.ok
    reason = next(m for m in report.messages if m.startswith("device check not possible: torch_tpu 0.2.0 needs"))
    assert f"not torch 2.9.0+cpu; run setup(stack='torch_tpu', install=True) or: {report.commands()}, then" in reason
    assert "torch_xla" not in report.commands()
    # On a torch it supports, yet it fails to import: the check's failure says what it needs.
    # (torch's autoload off: where the real torch-tpu is installed, its entry point would import the broken one)
    env = {**COLAB, "PYTHONPATH": path, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           **stack("2.15.0", torch_xla=None, torch_tpu="0.2.0", gcsfs="2026.10.1", ipywidgets="7.7.1", matplotlib="3.10.0")}
    report = tpu.setup(environ=env, root=colab_tpu_root(tmp_path / "new"), extras=())
    assert report.verified is False and report.missing == ()
    failure = next(m for m in report.messages if m.startswith("device check failed"))
    assert "torch_tpu did not import: it needs torch " in failure and "libtpu.so: cannot open" in failure
    # The hint of a failed check with only torch's command to run (what raised TypeError before).
    report.missing, report.pip_command = ("torch>=2.11",), None
    report.torch_command = tpu.torchtpu.install_commands("2.9.0+cpu", torchvision=False)[0]
    monkeypatch.setattr(setup_py.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "boom"))
    setup_py._verify(report, env, report.messages)
    assert report.commands().startswith("pip install 'torch>=")
    assert f"install the missing packages first: {report.commands()}" in report.messages[-1]
