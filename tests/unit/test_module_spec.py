"""A model of the user's own: `ModuleSpec` over a plain nn.Module, and the specs `--model
FILE.py:NAME` and `--model MODULE:NAME` name. The README's example file (shown there whole) is the
model; every refusal is one line before launch, exit 2. (Its runs: tests/dist/test_own_model.py,
test_train_equivalence.py, test_switch.py.)"""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from shardshift.cli.main import main
from shardshift.layout import Layout
from shardshift.models import ModuleSpec, model_spec, recorded_spec
from shardshift.models.space import state_space
from shardshift.reshard.training import FIRST, LAST, ParamRule
from support import EXAMPLE_MODEL, REPO

EXAMPLE = REPO / "examples" / "tiny_decoder.py"


def test_the_readme_shows_the_example_file_whole():
    block = "\n".join(f"    {line}" if line else "" for line in EXAMPLE.read_text().rstrip("\n").split("\n"))
    assert f"\n\n{block}\n\n" in (REPO / "README.md").read_text()


def test_the_spec_derives_the_split_the_sizes_and_the_state_space_from_the_module():
    spec = model_spec(EXAMPLE_MODEL)
    assert isinstance(spec, ModuleSpec) and spec.name == EXAMPLE_MODEL
    assert (spec.vocab_size, spec.hidden_size, spec.seq_len, spec.pipeline.num_layers) == (256, 32, 30, 5)
    model = spec.build()
    assert spec.num_params() == sum(p.numel() for p in model.parameters()) == 81_184
    space = state_space(spec, torch.float32)
    params = {t.name: t for t in space.tensors if t.kind == "param"}
    assert set(params) == {name for name, _ in model.named_parameters()}
    # The plan's colwise q splits its weight's rows and bias over tp, rowwise o its weight's columns
    # (checked against DTensor's placements in tests/dist/test_switch.py); the rest stays whole.
    rules = {name: space.rule(name) for name in params}
    assert rules["layers.2.q.weight"] == ParamRule(2, (("tp", 0),)) and rules["layers.2.q.bias"].splits == (("tp", 0),)
    assert rules["layers.2.o.weight"].splits == (("tp", 1),) and rules["layers.2.o.bias"].splits == ()
    assert rules["pos.weight"] == ParamRule(FIRST, ()) and rules["head.weight"] == ParamRule(LAST, ())
    # Initial values: a function of (seed, name) only; biases zero, norm gains one.
    q = spec.init_value("layers.3.q.weight", torch.Size([32, 32]), torch.float64, 5)
    assert torch.equal(q, spec.init_value("layers.3.q.weight", torch.Size([32, 32]), torch.float64, 5))
    assert not torch.equal(q, spec.init_value("layers.3.k.weight", torch.Size([32, 32]), torch.float64, 5))
    assert 0.015 < q.std() < 0.025
    assert torch.equal(spec.init_value("layers.0.q.bias", torch.Size([32]), torch.float32, 5), torch.zeros(32))
    assert torch.equal(spec.init_value("norm.weight", torch.Size([32]), torch.float32, 5), torch.ones(32))


def test_a_file_is_named_by_its_absolute_path_and_imported_once(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    relative = model_spec("examples/tiny_decoder.py:spec")
    assert relative == model_spec(EXAMPLE_MODEL) and hash(relative) == hash(model_spec(EXAMPLE_MODEL))
    assert relative.name == EXAMPLE_MODEL and relative.module is model_spec(EXAMPLE_MODEL).module
    # A checkpoint's name and configuration build it back, with the recorded sizes.
    wider = recorded_spec(relative.name, {**relative.config_dict(), "hidden_size": 48})
    assert wider.hidden_size == 48 and wider.num_params() > relative.num_params()
    # Harnesses that start a run of their own pass the name on (`train_argv`).
    from shardshift.cli.main import build_parser
    from shardshift.cli.train import config_from_args, train_argv
    from shardshift.train.config import TrainConfig

    cfg = TrainConfig(layout=Layout(fsdp=2), model=relative, steps=4, global_batch=8)
    argv = train_argv(cfg, nproc=2, timeout_s=10.0)
    monkeypatch.chdir(tmp_path)  # from another directory: the same file
    assert config_from_args(build_parser(argv).parse_args(argv), cfg.layout) == cfg


def _write(path, body: str, prelude: str = "") -> str:
    path.write_text(prelude + textwrap.dedent(body))
    return str(path)


def test_a_module_on_the_path_names_a_factory_of_a_spec(monkeypatch, tmp_path):
    package = tmp_path / "own_models"
    package.mkdir()
    _write(package / "__init__.py", "")
    _write(package / "decoders.py", f"""
        import importlib.util

        loaded = importlib.util.spec_from_file_location("tiny_decoder_copy", {str(EXAMPLE)!r})
        example = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(example)


        def wide():
            return example.spec.with_config({{**example.spec.config, "hidden_size": 64}})
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = model_spec("own_models.decoders:wide")
    assert spec.name == "own_models.decoders:wide" and spec.hidden_size == 64
    assert recorded_spec(spec.name, spec.config_dict()) == spec


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardshift: error: "), err
    return err


MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    from shardshift.models import ModuleSpec


    class Net(nn.Module):
        def __init__(self, vocab_size, hidden_size, seq_len, n_layers=2):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, hidden_size)
            self.layers = nn.ModuleDict({str(i): nn.Linear(hidden_size, hidden_size) for i in range(n_layers)})
            self.head = nn.Linear(hidden_size, vocab_size)
    """)
SIZES = "vocab_size=256, hidden_size=8, seq_len=4"


@pytest.mark.parametrize("body, name, needle", [
    ("", "missing.py:spec", r"--model missing.py:spec: no such file {tmp}/missing.py; give a Python file"),
    (f"spec = ModuleSpec(module=Net, config=dict({SIZES}), layers='layers', first=('embed',), last=('head',))\n"
     "other = spec", "f.py:model", r"{tmp}/f.py defines no model \(the ModelSpecs it defines: other, spec\)"),
    ("spec = 3", "f.py:spec", r"spec is a int, not a ModelSpec; give a spec"),
    (f"spec = Net({SIZES})", "f.py:spec", r"spec is a Net, not a ModelSpec; give a spec \(such as "
                                         r"shardshift.models.ModuleSpec\(...\)\) or a function of no arguments"),
    ("def spec():\n    return Net", "f.py:spec", r"spec returns a type, not a ModelSpec"),
    ("", "no_such_package.models:spec", r"no module named no_such_package here; install it, put its directory on "
                                        r"PYTHONPATH, or name its file \(--model path/to/models.py:spec\)"),
    ("", "f.py:", r"after the last colon give the name of a ModelSpec"),
    ("spec = ModuleSpec(module=Net, config=dict(vocab_size=256, hidden_size=8), layers='layers')", "f.py:spec",
     r"config\['seq_len'\] is None; give a whole number >= 1"),
    (f"spec = ModuleSpec(module=Net, config=dict({SIZES}, n_layers=2), layers='embed')", "f.py:spec",
     r"layers='embed' must name the nn.ModuleDict of Net's repeated layers, keyed '0', '1', ... \(a stage keeps its layers' names\); it is Embedding"),
    (f"spec = ModuleSpec(module=Net, config=dict({SIZES}), layers='layers', first=('embed',))", "f.py:spec",
     r"parameter head.weight is in no layer of layers and in no module of first or last; name its module"),
    (f"spec = ModuleSpec(module=Net, config=dict({SIZES}), layers='layers', first=('embed',), last=('head',), "
     "plan={'layers.*.proj': 'colwise'})", "f.py:spec", r"plan names layers.\*.proj, which matches no module of Net"),
    (f"spec = ModuleSpec(module=Net, config=dict({SIZES}), layers='layers', first=('embed',), last=('head',), "
     "plan={'layers.*': 'sideways'})", "f.py:spec", r"plan makes layers.\* 'sideways'; choose one of colwise"),
])
def test_names_that_give_no_spec_and_specs_that_do_not_fit_are_refused_in_one_line(body, name, needle, tmp_path,
                                                                                 capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if body:
        _write(tmp_path / "f.py", body, MODULE)
    err = _refused(capsys, ["train", "--nproc", "1", "--model", name])
    assert re.search(needle.format(tmp=re.escape(str(tmp_path))), err), err


@pytest.mark.parametrize("layout, needle", [
    ("tp=8", "tp=8 does not divide n_heads=4; choose tp in {1, 2, 4}"),
    ("tp=3", "tp=3 does not divide the out_features=32 of layers.0.q (colwise); choose tp in {1, 2, 4}"),
    ("pp=6", "pp=6 is larger than the number of layers (layers holds 5); choose pp <= 5"),
])
def test_layouts_the_example_cannot_take_are_refused_before_launch(layout, needle, capsys):
    nproc = str(Layout.parse(layout).world_size)
    assert needle in _refused(capsys, ["train", "--nproc", nproc, "--layout", layout, "--model", EXAMPLE_MODEL])


def test_a_shared_parameter_is_refused_under_pp_and_no_plan_under_tp(tmp_path, capsys):
    tied = _write(tmp_path / "tied.py", prelude=MODULE, body=f"""
    class Tied(Net):
        def __init__(self, **config):
            super().__init__(**config)
            self.head.weight = self.embed.weight


    spec = ModuleSpec(module=Tied, config=dict({SIZES}), layers='layers', first=('embed',), last=('head',))
    """)
    err = _refused(capsys, ["train", "--nproc", "2", "--layout", "pp=2", "--model", f"{tied}:spec"])
    assert "pp=2: " in err and "shares embed.weight with head.weight, one parameter that two pipeline stages would " \
                                "both need; train it with pp=1" in err
    err = _refused(capsys, ["train", "--nproc", "2", "--layout", "tp=2", "--model", f"{tied}:spec"])
    assert "tp=2: " in err and "has no tensor-parallel plan; give ModuleSpec a plan, or train with tp=1" in err
    assert model_spec(f"{tied}:spec").check_layout(Layout(fsdp=2)) is None


def test_simulate_plans_the_example_through_its_spec(capsys, monkeypatch):
    """`simulate switch --model FILE.py:NAME` plans on the state space the trainer derives from the
    same spec (tests/dist/test_switch.py: its bytes moved are the real switch's)."""
    from shardshift.simulate.switch import model_space

    assert model_space(EXAMPLE_MODEL, "float32") is state_space(model_spec(EXAMPLE_MODEL), torch.float32)
    argv = "simulate switch --model examples/tiny_decoder.py:spec --ranks 4 --from fsdp=2,tp=2 --to pp=2,dp=2"
    assert f"    shardshift {argv}\n" in (REPO / "README.md").read_text()
    monkeypatch.chdir(REPO)
    assert main(argv.split()) == 0
    assert re.search(r"moved [\d.]+ [KM]iB \(lower bound", capsys.readouterr().out)


def test_a_file_may_hold_a_spec_of_a_built_in_family(tmp_path):
    """Any ModelSpec (here a GPT of sizes of its own) is named the same way."""
    from shardshift.models.gpt import GPTSpec

    path = _write(tmp_path / "gpt.py", """
        from shardshift.models.gpt import GPTConfig, GPTSpec

        spec = GPTSpec("mine", GPTConfig(n_layer=3, n_head=2, d_model=16, seq_len=8))
        """)
    spec = model_spec(f"{path}:spec")
    assert isinstance(spec, GPTSpec) and spec.name == f"{path}:spec" and spec.config.n_layer == 3
