"""Models, data and the single-process reference shared by the ZeRO tests."""

import contextlib

import torch
import torch.nn as nn

from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch

CFG = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=67, block_size=16)  # odd vocab: odd-sized tensors
LR = 1e-2
WD = 0.1


class Gain(nn.Module):
    """One trainable element: smaller than any world size, so most ranks' shards of it are padding."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.full((1,), 1.25))

    def forward(self, x):
        return x * self.g


class ZNet(nn.Module):
    """The tiny built-in GPT (tied embedding / LM head) plus an odd-sized bias, a one-element gain and a
    frozen parameter, all feeding the loss."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.gpt = GPT(gpt_config("tiny", **CFG, tie_embeddings=tie), seed=0)
        v = CFG["vocab_size"]
        gen = torch.Generator().manual_seed(7)
        self.odd_bias = nn.Parameter(torch.randn(v, generator=gen) * 0.1)  # 67 elements
        self.gain = Gain()
        self.frozen_mix = nn.Parameter(torch.rand(v, generator=gen), requires_grad=False)

    def forward(self, idx, targets):
        logits = self.gain(self.gpt(idx)) + self.odd_bias * self.frozen_mix  # [b, s, v]
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batches(steps: int, batch: int, seq: int = 12):
    cfg = gpt_config("tiny", **CFG)
    return [synthetic_batch(cfg, batch, seq, seed=100 + s) for s in range(steps)]


def reference(steps: int, batch: int, clip: float | None = None, optimizer=torch.optim.AdamW, **opt_kw):
    """One process, whole batch: ``(losses, parameters, clip norms, eval loss)`` after ``steps`` optimizer
    steps; the eval loss is on the first batch, under no_grad, after training."""
    model = ZNet()
    opt_kw = opt_kw or {"lr": LR, "weight_decay": WD}
    opt = optimizer([p for p in model.parameters() if p.requires_grad], **opt_kw)
    losses, norms = [], []
    for idx, tgt in batches(steps, batch):
        loss = model(idx, tgt)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = model(*batches(1, batch)[0]).item()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms, eval_loss


def eval_loss(model, mesh, batch: int) -> float:
    """The no-grad loss of a wrapped model on the first batch (this rank's slice, averaged over ranks)."""
    from pyparallel import comm

    rank, local = mesh.dp_rank, batch // mesh.dp
    idx, tgt = batches(1, batch)[0]
    with torch.no_grad():
        loss = model(idx[rank * local:(rank + 1) * local], tgt[rank * local:(rank + 1) * local])
    t = torch.tensor([loss.item()])
    comm.all_reduce(t, mesh.dp_group, op="avg")
    return t.item()


def train(model, opt, mesh, steps: int, batch: int, micro: int):
    """The ordinary loop on this rank's slice of every batch, ``micro`` micro-batches per step; returns the
    whole-batch loss per step (averaged over ranks)."""
    from pyparallel import comm

    rank, world = mesh.dp_rank, mesh.dp
    local = batch // world
    losses = []
    for idx, tgt in batches(steps, batch):
        idx, tgt = idx[rank * local:(rank + 1) * local], tgt[rank * local:(rank + 1) * local]
        total = 0.0
        for m in range(micro):
            sl = slice(m * local // micro, (m + 1) * local // micro)
            ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = model(idx[sl], tgt[sl]) / micro
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([total])
        comm.all_reduce(t, mesh.dp_group, op="avg")
        losses.append(t.item())
    return losses
