"""What autocast_fx and autocast_graph say when a program does not trace as it runs.

Data-dependent Python control flow (an error naming the line and the ways out), graphs without the
node metadata the rewrite reads (``torch.fx.symbolic_trace``), and device moves that a trace without
autocast recorded as casts to float32 (a warning naming the node and the fix).
"""

from __future__ import annotations

import inspect
import re
import string
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # noqa: E402

import fmp.torch  # noqa: E402
from fmp.torch._fx._trace import (  # noqa: E402
    _MSG_DATA_DEPENDENT,
    _MSG_NO_META,
    _MSG_TRACED_MOVE,
    _NOTE_REAL_TRACE,
)


def _message_re(template, **fields):
    """A regex matching ``template`` with ``fields`` filled in and any other field left free."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    filled = {name: fields.get(name, "\0") for name in names}
    return ".*".join(re.escape(part) for part in template.format(**filled).split("\0"))


def _line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


# ---- data-dependent control flow ----------------------------------------------------------------


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.max() > 0:
            return y.relu()
        return y


def test_data_dependent_branch_names_the_line_and_the_ways_out():
    with pytest.raises(RuntimeError) as info:
        fmp.torch.autocast_fx(_Branchy(), (torch.randn(2, 4),))
    line = _line_of(_Branchy.forward, "if y.max() > 0:")
    where = f"{__file__}:{line} (if y.max() > 0:)"
    assert str(info.value) == _MSG_DATA_DEPENDENT.format(where=where)
    assert "tracing_mode" not in str(info.value)  # make_fx's option, which autocast_fx does not have
    assert isinstance(info.value.__cause__, GuardOnDataDependentSymNode)
    # the way out the message gives: eager autocast runs the program as written
    model, x = _Branchy(), torch.randn(2, 4)
    with fmp.torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16


@pytest.mark.gallery
def test_hf_ctc_loss_with_labels_names_the_labels_check():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    model = transformers.Wav2Vec2ForCTC(config).eval()  # no dropout, layer drop or time masking
    audio, labels = torch.randn(2, 800), torch.randint(1, 16, (2, 5))
    with pytest.raises(RuntimeError, match=_message_re(_MSG_DATA_DEPENDENT)) as info:
        fmp.torch.autocast_fx(lambda a, b: model(a, labels=b).loss, (audio, labels))
    assert "modeling_wav2vec2.py:" in str(info.value)
    assert "labels.max() >= self.config.vocab_size" in str(info.value)
    assert f"(an installed package's code, reached from {__file__}:" in str(info.value)  # our lambda's line
    # without labels it traces, and the logits are eager autocast's
    gm = fmp.torch.autocast_fx(lambda a: model(a).logits, (audio,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(audio).logits
    assert torch.equal(gm(audio), expected)


@torch.library.custom_op("fmp_test::no_fake_kernel", mutates_args=())
def _no_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _skips_check_on_fake(x):
    # like a library that reads values only outside tracing (it recognises fake tensors, not real-mode tracing)
    if not isinstance(x, torch._subclasses.FakeTensor) and x.max() > 100:
        raise ValueError("too large")
    return _no_fake_kernel(x @ x)


def test_first_trace_error_wins_over_the_real_trace_data_dependence():
    with pytest.raises(RuntimeError) as info:
        fmp.torch.autocast_fx(_skips_check_on_fake, (torch.randn(2, 2),))
    assert "no_fake_kernel" in str(info.value)  # the op without a fake kernel, not the value check
    assert "tracing_mode" not in str(info.value)
    code = "if not isinstance(x, torch._subclasses.FakeTensor) and x.max() > 100:"
    note = _NOTE_REAL_TRACE.format(where=f"{__file__}:{_line_of(_skips_check_on_fake, code)} ({code})")
    assert note in getattr(info.value, "__notes__", [])


# ---- graphs without the metadata the rewrite reads --------------------------------------------------


def test_symbolic_trace_graph_says_metadata_is_missing():
    gm = torch.fx.symbolic_trace(nn.Linear(4, 4))
    with pytest.raises(ValueError) as info:
        fmp.torch.autocast_graph(gm, "cpu")
    first = next(iter(gm.graph.nodes))
    assert str(info.value) == _MSG_NO_META.format(node=first.name, op="placeholder")
    # the graphs the message names work
    x = torch.randn(2, 4)
    lin = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = lin(x)
    for graph in (make_fx(lin, pre_dispatch=True)(x), torch.export.export(lin, (x,)).module()):
        assert torch.equal(fmp.torch.autocast_graph(graph, "cpu")(x), expected)


def test_node_without_val_says_metadata_is_missing():
    gm = make_fx(lambda a: torch.mm(a, a), pre_dispatch=True)(torch.ones(2, 2))
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    mm.meta.pop("val")
    with pytest.raises(ValueError) as info:
        fmp.torch.autocast_graph(gm, "cpu")
    assert str(info.value) == _MSG_NO_META.format(node=mm.name, op="call_function")


# ---- device moves recorded as casts ------------------------------------------------------------------


class _Moves(nn.Module):
    """Moves a low-precision activation to the device it is on (a no-op in eager: the dtype stays)."""

    def __init__(self, move):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.move = move

    def forward(self, x):
        return self.move(self.lin(x), x) * 2


DEVICE_MOVES = {
    "to_device": lambda h, x: h.to(x.device),
    "to_str": lambda h, x: h.to("cpu"),
    "cpu": lambda h, x: h.cpu(),
}
CASTS = {  # dtype conversions the program wrote: cast under autocast as in eager
    "float": lambda h, x: h.float(),
    "to_dtype": lambda h, x: h.to(torch.float32),
    "to_other": lambda h, x: h.to(x),
    "to_device_dtype": lambda h, x: h.to(x.device, torch.float32),
}


def _eager(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


@pytest.mark.parametrize("move", sorted(DEVICE_MOVES))
def test_device_move_in_exported_graph_warns(move):
    model, x = _Moves(DEVICE_MOVES[move]), torch.randn(2, 4)
    assert _eager(model, x).dtype == torch.bfloat16
    exported = torch.export.export(model, (x,)).module()
    with pytest.warns(UserWarning) as record:
        gm = fmp.torch.autocast_graph(exported, ("cpu", torch.bfloat16))
    (warning,) = record
    assert re.fullmatch(_message_re(_MSG_TRACED_MOVE, traced="float32", now="bfloat16"), str(warning.message), re.S)
    assert f"{__file__}:" in str(warning.message)  # where the program made the move
    assert gm(x).dtype == torch.float32  # the graph as recorded: a cast to float32
    # the fixes the warning gives: trace under autocast, then the recorded dtype is autocast's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = torch.export.export(model, (x,)).module()
        assert torch.equal(fmp.torch.autocast_graph(under, ("cpu", torch.bfloat16))(x), _eager(model, x))
        assert torch.equal(fmp.torch.autocast_fx(model, (x,))(x), _eager(model, x))


@pytest.mark.parametrize("cast", sorted(CASTS))
def test_written_casts_in_exported_graph_do_not_warn(cast):
    model, x = _Moves(CASTS[cast]), torch.randn(2, 4)
    exported = torch.export.export(model, (x,)).module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = fmp.torch.autocast_graph(exported, ("cpu", torch.bfloat16))
    assert torch.equal(gm(x), _eager(model, x))


class _Aliases(nn.Module):
    """Upcasts a low-precision activation for one use and keeps using the activation itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.float().softmax(-1), h * 2


def test_no_op_conversion_aliases_later_uses_unless_traced_under_autocast():
    model, x = _Aliases(), torch.randn(2, 4)
    expected = _eager(model, x)
    assert [t.dtype for t in expected] == [torch.float32, torch.bfloat16]
    # traced in float32, h.float() returned h, so `h * 2` was recorded as a use of the cast (not reported)
    exported = torch.export.export(model, (x,)).module()
    assert [t.dtype for t in fmp.torch.autocast_graph(exported, "cpu")(x)] == [torch.float32, torch.float32]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = torch.export.export(model, (x,)).module()
    for got, ref in zip(fmp.torch.autocast_graph(under, "cpu")(x), expected, strict=True):
        assert torch.equal(got, ref)
