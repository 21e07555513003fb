"""Packed documents never see each other: gradients, outputs and the FlexAttention mask, on real text."""

import pytest
import torch
from shared_data import DATA_DIR

from hopperlm.config import ModelConfig
from hopperlm.data.tokenizer import ByteTokenizer
from hopperlm.model.attention import (
    dense_document_mask,
    document_mask,
    flex_document_attention,
    masked_attention,
    positions_from_doc_ids,
)
from hopperlm.model.transformer import build_model

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128, vocab_size=320)


def documents(lengths: list[int]) -> list[torch.Tensor]:
    """Consecutive English lines of HornMT as byte tokens, cut to the given lengths."""
    lines = (DATA_DIR / "hornmt" / "eng.txt").read_text(encoding="utf-8").splitlines()
    tok = ByteTokenizer()
    return [torch.tensor(tok.encode(line)[:n]) for line, n in zip(lines, lengths, strict=False)]


def packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    docs = documents(lengths)
    assert [len(d) for d in docs] == lengths  # the lines are long enough
    tokens = torch.cat(docs)[None]  # (1, T)
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    return tokens, doc_ids, docs


def test_positions_restart_per_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert positions_from_doc_ids(doc_ids).tolist() == [
        [0, 1, 2, 0, 1, 0, 1, 2, 3],
        [0, 1, 2, 3, 4, 5, 6, 7, 8],
    ]


def test_no_gradient_crosses_a_document_boundary():
    torch.manual_seed(0)
    model = build_model(CFG, seed=0)
    tokens, doc_ids, _ = packed([30, 45, 25])
    bounds = [(0, 30), (30, 75), (75, 100)]
    captured = {}

    def keep(module, inputs, out):
        captured["emb"] = out

    model.embed.register_forward_hook(keep)
    for i in (10, 29, 30, 60, 74, 99):
        captured.clear()
        model.zero_grad()
        logits = model(tokens, doc_ids=doc_ids)
        emb = captured["emb"]
        emb.retain_grad()
        logits[0, i].logsumexp(-1).backward()
        grad = emb.grad[0].abs().sum(-1)  # (T,): how much the output at i depends on each input token
        start, end = next(b for b in bounds if b[0] <= i < b[1])
        assert torch.count_nonzero(grad[:start]) == 0, f"position {i} sees an earlier document"
        assert torch.count_nonzero(grad[i + 1 :]) == 0, f"position {i} sees the future"
        assert torch.all(grad[start : i + 1] > 0), f"position {i} must see its own document"


def test_packed_outputs_equal_each_document_alone():
    model = build_model(CFG, seed=1).eval()
    tokens, doc_ids, docs = packed([17, 50, 33, 28])
    with torch.no_grad():
        together = model(tokens, doc_ids=doc_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])  # each from position 0, plain causal path
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        unmasked = model(tokens)[0]
    assert not torch.allclose(unmasked[17:], alone[17:], atol=1e-3)  # the mask is what made them equal
    # One document per row is exactly the unmasked causal path.
    one_doc = torch.zeros_like(doc_ids)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, doc_ids=one_doc)[0], unmasked, atol=2e-5, rtol=1e-4)


def test_loss_with_targets_and_batch_rows():
    model = build_model(CFG, seed=2).eval()
    t1, d1, _ = packed([40, 24])
    t2, d2, _ = packed([10, 20, 34])
    tokens, doc_ids = torch.cat([t1, t2]), torch.cat([d1, d2])
    with torch.no_grad():
        logits = model(tokens, doc_ids=doc_ids)
        for row in range(2):
            torch.testing.assert_close(
                logits[row : row + 1], model(tokens[row : row + 1], doc_ids=doc_ids[row : row + 1])
            )
        targets = tokens.roll(-1, dims=1)
        loss = model(tokens, targets, doc_ids=doc_ids)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, want)


def test_dense_mask_is_block_diagonal_causal():
    mask = dense_document_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert document_mask(torch.tensor([[0, 1]])).dense is not None  # CPU: the dense fallback


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_mask_equals_the_dense_mask_on_cpu():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0] * 40 + [1] * 70 + [2] * 18, [0] * 100 + [1] * 28])
    B, T = doc_ids.shape
    q, k, v = torch.randn(B, 4, T, 16), torch.randn(B, 2, T, 16), torch.randn(B, 2, T, 16)

    def same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    try:
        block_mask = flex.create_block_mask(same_document, B, None, T, T, device="cpu")
        got = flex_document_attention(q, k, v, block_mask, enable_gqa=True, compiled=False)
    except Exception as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"FlexAttention does not run on this CPU build: {e}")
    from hopperlm.model.attention import DocumentMask

    want = masked_attention(q, k, v, DocumentMask(dense=dense_document_mask(doc_ids)), enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the FlexAttention path")
def test_flex_path_on_cuda_matches_each_document_alone():
    """On CUDA the model takes the FlexAttention BlockMask path; in bf16 it must agree with the dense mask and
    with running each document alone (to bf16 precision), and no gradient may cross a boundary."""
    model = build_model(CFG, device="cuda", seed=3).eval()
    tokens, doc_ids, docs = packed([37, 64, 27])
    tokens, doc_ids = tokens.cuda(), doc_ids.cuda()
    mask = document_mask(doc_ids)
    assert mask.block_mask is not None  # not the dense fallback
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        together = model(tokens, doc_ids=doc_ids)[0].float()
        alone = torch.cat([model(d[None].cuda())[0] for d in docs]).float()
    torch.testing.assert_close(together, alone, atol=3e-2, rtol=3e-2)
    emb = {}
    model.embed.register_forward_hook(lambda m, i, out: emb.update(out=out))
    logits = model.train()(tokens, doc_ids=doc_ids)
    emb["out"].retain_grad()
    logits[0, 70].logsumexp(-1).backward()
    assert (
        torch.count_nonzero(emb["out"].grad[0, :37]) == 0
        and torch.count_nonzero(emb["out"].grad[0, 71:]) == 0
    )


def test_cuda_path_builds_the_block_mask_compiled_once_per_forward(monkeypatch):
    """Where FlexAttention serves the mask (CUDA), it is built by the compiled create_block_mask, once per
    forward for every layer. On the CPU the decision is checked with FlexAttention pretended available and the
    compiled creation recorded; its speed on a GPU is `hopperlm bench`'s to measure."""
    from hopperlm.model import attention

    calls, used = [], []

    def compiled_create(mask_mod, B, H, Q_LEN, KV_LEN, device=None):
        calls.append((B, H, Q_LEN, KV_LEN, torch.device(device).type))
        return "block mask"

    def flex(q, k, v, block_mask, enable_gqa):
        used.append(block_mask)
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "flex_unavailable_reason", lambda device: None)
    monkeypatch.setattr(attention, "_compiled_create_block_mask", lambda: compiled_create, raising=False)
    monkeypatch.setattr(attention, "flex_document_attention", flex)
    model = build_model(CFG, seed=0).eval()
    tokens, doc_ids, _ = packed([30, 45, 25])
    with torch.no_grad():
        model(tokens, doc_ids=doc_ids)
    assert calls == [(1, None, 100, 100, "cpu")]  # once, though the model has two layers
    assert used == ["block mask"] * CFG.n_layers
    assert document_mask(doc_ids, dropout=0.1).dense is not None  # dropout: the exact dense path still


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the FlexAttention path")
def test_compiled_block_mask_equals_eager_and_compiles_once():
    """The compiled creation builds the very BlockMask the eager one does, and each forward's new mask_mod
    closure (over new doc_ids) reuses one compiled graph: no recompilation per micro-batch. (On a CPU the same
    check passes but compiling costs ~50 s cold: it runs where the path is used, in the GPU campaign.)"""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from torch._dynamo.utils import counters

    from hopperlm.model import attention

    assert attention.flex_unavailable_reason(torch.device("cuda")) is None
    torch._dynamo.reset()
    counters.clear()
    batches = ([[40, 70, 146], [200, 56]], [[5, 60, 63, 128], [256]], [[128, 128], [1, 255]])
    for rows in batches:
        doc_ids = torch.stack(
            [torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows]
        ).cuda()

        def same_document(b, h, q_idx, kv_idx, doc_ids=doc_ids):
            return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        got = document_mask(doc_ids).block_mask
        want = flex.create_block_mask(same_document, 2, None, 256, 256, device="cuda")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
