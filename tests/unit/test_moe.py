"""The mixture-of-experts family through the model interface: its parameters and the state space
derived from its plan, its initialisation, the dropless block against a token-by-token reference
(and against a dispatch that holds the experts in two parts, as expert parallelism will), routing
ties, the load-balancing term against transformers' and as a mean of per-sequence terms, the
pipeline stages' hand-over, and what it refuses."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from shardshift.layout import Coord, Layout
from shardshift.models import model_names, model_spec
from shardshift.models.moe.config import PRESETS, MoEConfig
from shardshift.models.moe.model import MoEExperts, SparseMoEBlock, balance_terms
from shardshift.models.moe.spec import MoESpec
from shardshift.models.space import state_space
from shardshift.models.spec import plan_matcher
from shardshift.reshard.space import Box, holding
from shardshift.train.sample import generate

TEST = model_spec("moe-test")  # 5 layers, hidden 32, 8 / 4 heads of 4, 4 experts of 24, top 2, shared 16


def _variant(base: str = "moe-test", **changes) -> MoESpec:
    spec = model_spec(base)
    return MoESpec(f"{base}-variant", dataclasses.replace(spec.config, **changes))


def _boxes(spec, layout: Layout, coord: Coord) -> dict:
    space = state_space(spec, torch.float32)
    return {t.key: holding(space, layout, coord, t) for t in space.tensors}


def _built(spec: MoESpec, dtype=torch.float64, seed: int = 1):
    """The whole model in `dtype` with its initial values, norm gains moved off 1."""
    model = spec.build().to(dtype)
    spec.init_buffers(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            param.copy_(spec.init_value(fqn, param.shape, dtype, seed))
            if fqn.endswith("norm.weight"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64).to(dtype))
    return model.eval()


def _tokens(batch: int, spec: MoESpec = TEST, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, spec.seq_len), generator=torch.Generator().manual_seed(seed))


# ---- names, sizes, the derived space --------------------------------------------------------------


def test_the_presets_resolve_by_name_and_round_trip_their_config():
    assert [name for name in model_names() if name.startswith("moe-")] == list(PRESETS) == [
        "moe-test", "moe-tiny", "moe-small"]
    for name in PRESETS:
        spec = model_spec(name)
        assert isinstance(spec, MoESpec) and spec.name == name
        assert spec.with_config(spec.config_dict()) == spec and hash(spec) == hash(model_spec(name))
        assert (spec.hf_config() is None) == (name == "moe-test")  # a shared expert: no Hugging Face form
    assert model_spec("moe-test", vocab_size=300).vocab_size == 300  # a prepared data's vocabulary


@pytest.mark.parametrize("name", ["moe-test", "moe-tiny"])
def test_the_parameter_names_shapes_and_count_are_the_built_models(name):
    spec = model_spec(name)
    cfg = spec.config
    with torch.device("meta"):
        model = spec.build()
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}
    assert spec.num_params() == sum(math.prod(s) for s in shapes.values())
    h, e, i, hd, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.head_dim, cfg.shared_expert_intermediate_size
    kv = cfg.n_kv_heads * hd
    layer = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, h), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "mlp.gate.weight": (e, h), "mlp.experts.gate_proj": (e, i, h), "mlp.experts.up_proj": (e, i, h),
             "mlp.experts.down_proj": (e, h, i), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if s:
        layer |= {"mlp.shared_expert.gate_proj.weight": (s, h), "mlp.shared_expert.up_proj.weight": (s, h),
                  "mlp.shared_expert.down_proj.weight": (h, s), "mlp.shared_expert_gate.weight": (1, h)}
    expected = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
                "lm_head.weight": (cfg.vocab_size, h)}
    expected |= {f"model.layers.{n}.{fqn}": shape for n in range(cfg.n_layers) for fqn, shape in layer.items()}
    assert shapes == expected
    assert set(model.state_dict()) == set(expected)  # inv_freq is not saved
    assert (name == "moe-test") == bool(s)  # the tiny model has no shared expert, as Qwen3-MoE
    assert _variant(qk_norm=False).num_params() == TEST.num_params() - 5 * 2 * 4


def test_every_plan_entry_names_modules_and_the_router_and_experts_are_not_split():
    with torch.device("meta"):
        model = TEST.build()
    names = [name for name, _ in model.named_modules()]
    for pattern in TEST.tp_plan:
        assert any(plan_matcher({pattern: "x"})(name) for name in names), pattern
    style_of = plan_matcher(TEST.tp_plan)
    assert style_of("model.layers.3.mlp.gate") is None and style_of("model.layers.3.mlp.experts") is None
    assert style_of("model.layers.3.self_attn.q_norm") == "replicated_with_grad_allreduce"
    plain = _variant(qk_norm=False, shared_expert_intermediate_size=0)
    assert set(plain.tp_plan) == {f"model.layers.*.self_attn.{p}_proj" for p in "qkvo"}


def test_the_space_follows_the_plan_and_the_split():
    layout = Layout(tp=2, pp=2)  # layers 0..2 on the first stage, 3..4 on the last
    last = _boxes(TEST, layout, layout.coord(layout.world_size - 1))  # last stage, tp rank 1
    p = "param:model.layers.4."
    assert last[p + "self_attn.q_proj.weight"] == Box((16, 0), (16, 32))  # 4 of the 8 query heads
    assert last[p + "self_attn.k_proj.weight"] == Box((8, 0), (8, 32))  # their 2 key-value heads
    assert last[p + "self_attn.o_proj.weight"] == Box((0, 16), (32, 16))
    assert last[p + "self_attn.q_norm.weight"] == Box((0,), (4,))  # replicated: whole
    assert last[p + "mlp.gate.weight"] == Box((0, 0), (4, 32))  # the router: whole
    assert last[p + "mlp.experts.gate_proj"] == Box((0, 0, 0), (4, 24, 32))  # the experts: whole under tp
    assert last[p + "mlp.experts.down_proj"] == Box((0, 0, 0), (4, 32, 24))
    assert last[p + "mlp.shared_expert.up_proj.weight"] == Box((8, 0), (8, 32))
    assert last[p + "mlp.shared_expert.down_proj.weight"] == Box((0, 8), (32, 8))
    assert last[p + "mlp.shared_expert_gate.weight"] == Box((0, 0), (1, 32))
    assert last["param:lm_head.weight"] == Box((0, 0), (259, 32))
    assert last["param:model.layers.2.mlp.experts.up_proj"] is None  # the first stage's
    assert last["param:model.embed_tokens.weight"] is None

    layout = Layout(fsdp=4)
    third = _boxes(TEST, layout, layout.coord(3))
    assert third["param:model.layers.0.mlp.experts.gate_proj"] == Box((3, 0, 0), (1, 24, 32))  # one expert each
    assert third["exp_avg:model.layers.0.mlp.experts.down_proj"] == Box((3, 0, 0), (1, 32, 24))
    assert third["param:model.embed_tokens.weight"] == Box((195, 0), (64, 32))  # 259 rows: 65, 65, 65, 64
    assert third["param:model.layers.1.mlp.gate.weight"] == Box((3, 0), (1, 32))

    layout = Layout(fsdp=2, tp=2)
    boxes = _boxes(TEST, layout, layout.coord(3))  # fsdp rank 1, tp rank 1
    assert boxes["param:model.layers.0.mlp.experts.up_proj"] == Box((2, 0, 0), (2, 24, 32))  # fsdp only
    assert boxes["param:model.layers.0.self_attn.v_proj.weight"] == Box((12, 0), (4, 32))  # tp, then fsdp


def test_initial_values_depend_on_the_seed_and_the_name_only():
    tiny = model_spec("moe-tiny")  # 8 layers: residual projections scaled by 1/4
    fqn, shape = "model.layers.2.mlp.experts.gate_proj", torch.Size((8, 48, 128))
    first = tiny.init_value(fqn, shape, torch.float64, seed=7)
    assert torch.equal(first, tiny.init_value(fqn, shape, torch.float64, seed=7))
    assert not torch.equal(first, tiny.init_value(fqn, shape, torch.float64, seed=8))
    assert not torch.equal(first, tiny.init_value(fqn.replace("gate_proj", "up_proj"), shape, torch.float64, seed=7))
    assert torch.equal(tiny.init_value(fqn, shape, torch.float32, seed=7), first.float())
    assert abs(first.std().item() - 0.02) < 1e-3
    router = tiny.init_value("model.layers.0.mlp.gate.weight", torch.Size((8, 128)), torch.float64, seed=7)
    assert abs(router.std().item() - 0.02) < 2e-3
    down = tiny.init_value("model.layers.0.mlp.experts.down_proj", torch.Size((8, 128, 48)), torch.float64, seed=7)
    assert abs(down.std().item() - 0.02 / 4) < 1e-3
    shared_down = TEST.init_value("model.layers.0.mlp.shared_expert.down_proj.weight", torch.Size((32, 16)),
                                  torch.float64, seed=7)
    assert abs(shared_down.std().item() - 0.02 / math.sqrt(10)) < 1e-3  # 5 layers
    assert torch.equal(tiny.init_value("model.layers.0.self_attn.k_norm.weight", torch.Size((8,)), torch.float64, 7),
                       torch.ones(8))


# ---- the block ------------------------------------------------------------------------------------


def _block(spec: MoESpec = TEST, seed: int = 2) -> SparseMoEBlock:
    block = SparseMoEBlock(spec.config).double()
    with torch.no_grad():
        for fqn, param in block.named_parameters():
            param.copy_(spec.init_value(f"model.layers.0.mlp.{fqn}", param.shape, torch.float64, seed) * 20)
    return block


def _reference(block: SparseMoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's softmax, the top_k experts, each expert on the token alone."""
    cfg_k, out = block.top_k, torch.zeros_like(x)
    e = block.experts
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            token = x[b, t]
            probs = torch.softmax(block.gate.weight @ token, dim=-1)
            chosen = sorted(range(len(probs)), key=lambda i: -probs[i].item())[:cfg_k]
            weights = probs[chosen] / probs[chosen].sum() if block.norm_topk_prob else probs[chosen]
            for w, i in zip(weights, chosen):
                out[b, t] += w * (e.down_proj[i] @ (F.silu(e.gate_proj[i] @ token) * (e.up_proj[i] @ token)))
            if block.shared_expert is not None:
                s = block.shared_expert
                shared = s.down_proj.weight @ (F.silu(s.gate_proj.weight @ token) * (s.up_proj.weight @ token))
                out[b, t] += torch.sigmoid(block.shared_expert_gate.weight @ token) * shared
    return out


@pytest.mark.parametrize("changes", [{}, {"norm_topk_prob": False, "shared_expert_intermediate_size": 0},
                                     {"top_k": 3}, {"top_k": 1}])
def test_the_dropless_block_is_the_token_by_token_reference(changes):
    spec = _variant(**changes)
    block = _block(spec)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        out, stats = block(x)
        expected = _reference(block, x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert out.abs().mean() > 1e-2  # not vacuous
    counts = stats[:, :4]
    assert torch.equal(counts.sum(1), torch.full((3,), 7.0 * spec.config.top_k, dtype=torch.float64))
    assert (counts > 0).sum() > 3 * 2  # the tokens spread over the experts
    torch.testing.assert_close(stats[:, 4:].sum(1), torch.full((3,), 7.0, dtype=torch.float64), rtol=1e-14, atol=0)


class _TwoHalves:
    """A dispatch that holds the experts in two parts (experts 0, 1 and 2, 3), as two ranks of
    ep=2 would: the rows of each part go to experts that index what they hold from 0."""

    def __init__(self, experts: MoEExperts):
        self.parts = []
        for held in (slice(0, 2), slice(2, 4)):
            part = MoEExperts(2, 32, 24).double()
            with torch.no_grad():
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(part, name).copy_(getattr(experts, name)[held])
            self.parts.append(part)
        self.calls = 0

    def __call__(self, rows, counts, experts):
        self.calls += 1
        first = int(counts[:2].sum())
        return torch.cat([self.parts[0](rows[:first], counts[:2]), self.parts[1](rows[first:], counts[2:])])


def test_a_dispatch_that_holds_the_experts_in_parts_computes_the_same():
    block = _block()
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        local, local_stats = block(x)
        block.dispatch = _TwoHalves(block.experts)
        moved, moved_stats = block(x)
    assert block.dispatch.calls == 1
    assert torch.equal(moved, local) and torch.equal(moved_stats, local_stats)


def test_every_expert_gets_a_gradient_even_with_no_tokens():
    block = _block()
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, 0] = torch.tensor([0.0, 0.0, 5.0, 5.0], dtype=torch.float64)
    x = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64).abs()
    out, stats = block(x)
    assert torch.equal(stats[0, :4], torch.tensor([0.0, 0.0, 4.0, 4.0], dtype=torch.float64))  # experts 0, 1 idle
    out.sum().backward()
    grad = block.experts.gate_proj.grad
    assert grad is not None and torch.equal(grad[:2], torch.zeros_like(grad[:2])) and grad[2:].abs().sum() > 0


def test_routing_ties_go_to_the_lower_expert_every_time():
    block = _block(_variant(top_k=2, norm_topk_prob=False, shared_expert_intermediate_size=0))
    with torch.no_grad():
        block.gate.weight.zero_()  # every probability 1/4
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        routing = block._route(x.reshape(-1, 32))
        assert torch.equal(routing.experts, torch.tensor([[0, 1]] * 10))
        assert torch.equal(routing.weights, torch.full((10, 2), 0.25, dtype=torch.float64))
        block.gate.weight[1] = block.gate.weight[3] = 1.0  # experts 1 and 3 tie above 0 and 2
        ties = block._route(x.abs().reshape(-1, 32))
        assert torch.equal(ties.experts, torch.tensor([[1, 3]] * 10))
        runs = [block(x)[0] for _ in range(3)]
    assert all(torch.equal(run, runs[0]) for run in runs)


# ---- the load-balancing term ----------------------------------------------------------------------


def _router_logits(model, tokens) -> tuple[list[torch.Tensor], tuple]:
    """Each layer's router logits (b * t, E), captured while the model runs, and its output."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
             for layer in model.model.layers.values()]
    with torch.no_grad():
        output = model(tokens)
    for hook in hooks:
        hook.remove()
    return logits, output


def _formula(layer_logits: list[torch.Tensor], experts: int, top_k: int) -> torch.Tensor:
    """transformers' formula as its 4.x releases wrote it (one-hot means over the layers' logits
    concatenated), in float64: E * sum over k and e of (share of tokens whose k-th choice is e) x
    (mean probability of e)."""
    probs = torch.softmax(torch.cat(layer_logits), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    tokens_per_expert = F.one_hot(chosen, experts).double().mean(dim=0)  # (top_k, E)
    return experts * (tokens_per_expert * probs.mean(dim=0).unsqueeze(0)).sum()


def test_the_balance_term_of_one_sequence_is_hugging_faces():
    model = _built(TEST)
    tokens = _tokens(1)
    layer_logits, (_, stats) = _router_logits(model, tokens)
    ours = balance_terms(stats, TEST.config.n_layers, TEST.seq_len)
    assert ours.shape == (1,) and ours.dtype == torch.float64
    expected = _formula(layer_logits, 4, 2)
    torch.testing.assert_close(ours[0], expected, rtol=1e-12, atol=0)
    assert abs(expected.item() - 2.0) > 1e-3  # not the balanced value (top_k): routing is uneven

    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    theirs = modeling.load_balancing_loss_func(tuple(layer_logits), num_experts=4, top_k=2)
    # transformers 5 sums the counts and the probabilities in float32 whatever the logits' dtype.
    torch.testing.assert_close(ours[0], theirs.double(), rtol=1e-6, atol=0)


def test_the_loss_of_a_batch_is_the_mean_of_its_sequences_losses():
    """Cross entropy and the balancing term are both means of per-sequence values, so a batch
    splits over data ranks and micro-batches as one sequence at a time."""
    model = _built(TEST)
    tokens, targets = _tokens(4, seed=2), _tokens(4, seed=3)
    with torch.no_grad():
        whole = TEST.loss(model(tokens), targets)
        each = [TEST.loss(model(tokens[i:i + 1]), targets[i:i + 1]) for i in range(4)]
        _, stats = model(tokens)
        terms = balance_terms(stats, TEST.config.n_layers, TEST.seq_len)
        alone = torch.cat([balance_terms(model(tokens[i:i + 1])[1], 5, TEST.seq_len) for i in range(4)])
    torch.testing.assert_close(whole, torch.stack(each).mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(terms, alone, rtol=1e-12, atol=0)
    assert terms.std() > 1e-4  # the sequences' terms differ: a mean of them is not one term of the batch
    logits = TEST.logits(model(tokens))
    assert logits.shape == (4, 13, 259)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(whole, ce + 0.001 * terms.mean(), rtol=1e-14, atol=0)


# ---- pipeline stages, sampling ---------------------------------------------------------------------


def test_pipeline_stages_keep_names_and_hand_over_hidden_states_and_statistics():
    model = _built(TEST)
    tokens = _tokens(2)
    with torch.no_grad():
        logits, stats = model(tokens)
    split = TEST.pipeline
    assert split.layer_of("model.layers.3.mlp.experts.down_proj") == 3
    first, last = _built(TEST), _built(TEST)
    for keep, stage in (((0, 1, 2), first), ((3, 4), last)):
        for index in list(stage.model.layers.keys()):
            if int(index) not in keep:
                del stage.model.layers[index]
    first.model.norm = first.lm_head = None
    last.model.embed_tokens = None
    assert [n for n, _ in last.named_parameters()][0] == "model.layers.3.self_attn.q_proj.weight"
    with torch.no_grad():
        hidden, partial = first(tokens)
        assert hidden.shape == (2, 13, 32) and partial.shape == (2, 8)
        got_logits, got_stats = last(hidden, partial)
    assert torch.equal(got_logits, logits) and torch.equal(got_stats, stats)


def test_sampling_reads_the_logits_out_of_the_output():
    model = _built(TEST)
    ids = generate(lambda x: TEST.logits(model(x)), TEST.seq_len, [65, 66], 5, 0.0, 0, 256)
    assert len(ids) == 5 and all(0 <= i < 256 for i in ids)


# ---- refusals --------------------------------------------------------------------------------------


def test_layouts_the_model_cannot_take_are_refused_with_the_fix():
    cases = [
        (TEST, Layout(ep=3), r"^ep=3 does not divide num_experts=4; choose ep in \{1, 2, 4\}$"),
        (TEST, Layout(tp=3), r"^tp=3 does not divide n_heads=8; choose tp in \{1, 2, 4\}$"),
        (TEST, Layout(tp=8), r"^tp=8 does not divide n_kv_heads=4; choose tp in \{1, 2, 4\}$"),
        (_variant(shared_expert_intermediate_size=18), Layout(tp=4),
         r"^tp=4 does not divide shared_expert_intermediate_size=18; choose tp in \{1, 2\}$"),
        (TEST, Layout(pp=6), r"^pp=6 is larger than the number of layers n_layers=5; choose pp <= 5$"),
    ]
    for spec, layout, message in cases:
        with pytest.raises(ValueError, match=message):
            spec.check_layout(layout)
    for layout in (Layout(tp=4), Layout(pp=5), Layout(dp=2, tp=2, pp=2), Layout(fsdp=8)):
        TEST.check_layout(layout)
    model_spec("moe-tiny").check_layout(Layout(tp=8))  # the experts are whole under tp: the heads bound it


def test_configurations_that_build_no_moe_are_refused():
    base = dict(n_layers=2, n_heads=4, n_kv_heads=2, hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                seq_len=8)
    for changes, message in [
        (dict(top_k=5), r"top_k=5 must be between 1 and num_experts=4"),
        (dict(top_k=0), r"top_k=0 must be between 1 and num_experts=4"),
        (dict(num_experts=0, top_k=0), r"num_experts=0 must be >= 1"),
        (dict(moe_intermediate_size=0), r"moe_intermediate_size=0 must be >= 1"),
        (dict(router_aux_loss_coef=-1.0), r"router_aux_loss_coef=-1.0 must be >= 0"),
        (dict(n_kv_heads=3), r"n_kv_heads=3 does not divide n_heads=4"),
    ]:
        with pytest.raises(ValueError, match=message):
            MoEConfig(**{**base, **changes})
