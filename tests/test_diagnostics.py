"""The Figure 1 diagnostics on hand-built cases with known answers, and on real models."""

import math

import pytest
import torch

from xsa_lm.analysis.diagnostics import diagnose, layer_statistics, mean_pairwise_cosine, self_attention_weights
from xsa_lm.analysis.run import PANELS, default_labels, figure
from xsa_lm.model import GPT, GPTConfig


def dense_self_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    T = q.size(-2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1).diagonal(dim1=-2, dim2=-1)


def test_chunked_a_ii_equals_the_dense_computation():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 37, 8, generator=g), torch.randn(2, 3, 37, 8, generator=g)
    dense = dense_self_attention(q, k)
    for chunk in (1, 5, 16, 64):
        assert torch.allclose(self_attention_weights(q, k, first=1, chunk=chunk), dense[..., 1:], atol=1e-6)
    assert torch.allclose(self_attention_weights(q, k, first=0, chunk=7)[..., 0], torch.ones(2, 3))  # causality


def test_attention_forced_to_the_diagonal_gives_a_ii_1_and_cos_y_v_1():
    T, D = 12, 16
    q = k = 50.0 * torch.eye(T, D).expand(1, 2, T, D)  # q_i . k_j = 2500 if i == j else 0
    v = torch.randn(1, 2, T, D, generator=torch.Generator().manual_seed(1))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(T, T).triu(1).bool(), -1e9)
    y = torch.softmax(scores, -1) @ v
    stats = layer_statistics(q, k, v, y, z=None)
    assert torch.allclose(stats["a_ii"], torch.ones(1, 2), atol=1e-6)
    assert torch.allclose(stats["cos_y_v"], torch.ones(1, 2), atol=1e-6)
    assert "cos_z_v" not in stats


def test_pairwise_cosine_of_identical_and_orthogonal_values():
    same = torch.randn(1, 1, 1, 8).expand(2, 3, 10, 8)
    assert torch.allclose(mean_pairwise_cosine(same), torch.ones(2, 3), atol=1e-6)
    orthogonal = torch.eye(10, 16).expand(1, 1, 10, 16) * 3.0
    assert torch.allclose(mean_pairwise_cosine(orthogonal), torch.zeros(1, 1), atol=1e-7)
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0]]).view(1, 1, 2, 2)
    assert mean_pairwise_cosine(opposite).item() == pytest.approx(-1.0)


def test_sinks_are_keys_but_not_positions():
    T, D, S = 6, 8, 2
    v = torch.randn(1, 1, S + T, D)
    v[..., :S, :] = 1e3  # sink values that would dominate cos_v_v if they counted as positions
    q = k = torch.zeros(1, 1, S + T, D)  # uniform attention
    stats = layer_statistics(q, k, v, v, z=None, n_sinks=S)
    assert stats["cos_v_v"].item() == pytest.approx(mean_pairwise_cosine(v[..., S:, :]).item())
    # uniform attention: a_ii = 1 / (number of visible keys, sinks included), averaged over tokens 2..T
    expected = sum(1 / (S + i + 1) for i in range(1, T)) / (T - 1)
    assert stats["a_ii"].item() == pytest.approx(expected)


def test_diagnose_a_model_layer_by_layer():
    torch.manual_seed(0)
    shape = dict(n_layer=3, d_model=32, n_head=4, head_dim=8, vocab_size=64, block_size=32, n_kv_head=2, n_sinks=1)
    config = GPTConfig(**shape, attention="xsa", xsa_layers=(1, 2))
    model = GPT(config)
    batches = [torch.randint(0, 64, (2, 32)) for _ in range(3)]
    rows = diagnose(model, batches, chunk=8)
    assert [r["attention"] for r in rows] == ["sa", "xsa", "xsa"]
    assert rows[0]["cos_z_v"] is None and rows[0]["norm_removed"] is None
    for row in rows[1:]:
        assert abs(row["cos_z_v"]) < 1e-5  # z is orthogonal to v
        assert 0 <= row["norm_removed"] <= 1
    for row in rows:
        assert -1 <= row["cos_v_v"] <= 1 and 0 < row["a_ii"] <= 1 and -1 <= row["cos_y_v"] <= 1
    assert all(b.attn.observer is None for b in model.blocks) and model.training  # left as found


def figure_rows() -> list[dict]:
    """An SA checkpoint and one with XSA on its last two layers, as `xsa-lm analyze` measures them."""
    torch.manual_seed(0)
    rows = []
    for label, config in (("sa", dict(attention="sa")), ("xsa-late", dict(attention="xsa", xsa_layers=(1, 2)))):
        model = GPT(GPTConfig(n_layer=3, d_model=32, n_head=4, head_dim=8, vocab_size=64, block_size=16, **config))
        rows += [{"label": label, **row} for row in diagnose(model, [torch.randint(0, 64, (2, 16))], chunk=8)]
    return rows


def test_diagnostics_figure_has_layer_ticks_axis_labels_and_the_xsa_panels_or_says_there_is_no_z():
    fig = figure(figure_rows())
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [title for _, title, _ in PANELS]
    assert [m for m, _, _ in PANELS] == ["cos_v_v", "a_ii", "cos_y_v", "cos_z_v", "norm_removed"]
    for ax in panels:
        assert ax.get_xlabel() == "layer" and ax.get_ylabel()
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks == [0, 1, 2]  # whole layers, no 0.5
    lines = {ax.get_title(): {line.get_label(): list(line.get_xdata()) for line in ax.lines} for ax in panels}
    assert lines["value similarity"] == {"sa": [0, 1, 2], "xsa-late": [0, 1, 2]}
    for _, title, _ in PANELS[3:]:  # z exists only in XSA layers: no SA line, XSA layers 1 and 2 only
        assert lines[title] == {"xsa-late": [1, 2]}
    (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert [t.get_text() for t in legend.get_texts()] == ["sa", "xsa-late"]  # each checkpoint once, its label
    fig = figure([r for r in figure_rows() if r["label"] == "sa"])  # SA checkpoints only: no z
    empty = [ax for ax in fig.axes if ax.get_title() and not ax.lines]
    assert len(empty) == 2 and all("no XSA layers" in ax.texts[0].get_text() for ax in empty)


def test_default_labels_are_run_names_saying_the_attention_once(tmp_path):
    def ckpt(run: str, name: str = "last") -> object:
        return tmp_path / run / "checkpoints" / f"{name}.ckpt"

    assert default_labels([ckpt("sa"), ckpt("xsa_lr3e-3")], ["sa", "xsa"]) == ["sa", "xsa_lr3e-3"]
    assert default_labels([ckpt("2025-01-02_10-00-00")], ["xsa"]) == ["2025-01-02_10-00-00 (xsa)"]
    assert default_labels([ckpt("xsa", "step-000020"), ckpt("xsa")], ["xsa", "xsa"]) == ["xsa step-000020", "xsa last"]
    runs = [tmp_path / d / "xsa" / "checkpoints" / "last.ckpt" for d in ("a", "b")]  # same name in two folders
    assert default_labels(runs, ["xsa", "xsa"]) == ["xsa last #0", "xsa last #1"]
