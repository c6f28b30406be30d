"""No rank needs the whole model (issue 13): a 30M-parameter GPT built on the meta device and read from a
sharded safetensors folder by 4 ZeRO-3 ranks peaks, per rank, at no more than 0.6x the resident memory of
one process training it from the same folder (0.44x measured; the benchmark's target at 150M parameters is
0.45x). Measured as benchmarks/memory.py does, in fresh processes: each one's peak
resident set (VmHWM) above its resident set right after importing torch and pyparallel."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import memory as bench  # noqa: E402


def test_zero3_rank_peaks_well_below_one_process(tmp_path):
    # Many small units (16 blocks of 1.8M parameters, a 4096-token vocabulary): what a rank holds beyond its
    # 16Ψ/N is about the gathered units in flight, which a few wide blocks would make a third of the model.
    a = bench.parse(["--layers", "16", "--embd", "384", "--heads", "6", "--vocab", "4096", "--block", "64",
                     "--batch", "4", "--seq", "32", "--steps", "2", "--repeats", "0", "--rows", "single,zero3",
                     "--folder", str(tmp_path / "weights"), "--shard-mb", "24"])
    out = bench.run(a)
    assert 25e6 < out["model"]["params"] < 35e6 and out["model"]["shards"] >= 3
    rows = {r["row"]: r for r in out["rows"]}
    single, zero3 = rows["single"], rows["zero3"]
    assert "peak_MiB" in single and "peak_MiB" in zero3, out["rows"]
    # the single process holds at least its 16 bytes per parameter (weights, gradients, AdamW's m and v)
    assert single["peak_MiB"] * 2**20 >= 16 * out["model"]["params"]
    print(f"ZeRO-3 rank peak / single peak: {zero3['ratio']:.3f}")
    assert zero3["ratio"] <= 0.6, f"ZeRO-3 rank peak {zero3['peak_MiB']:.0f} MiB is {zero3['ratio']:.2f}x " \
                                  f"the single process's {single['peak_MiB']:.0f} MiB"
    # The planner's per-rank peak (model states, activations, gathered units, the root unit held for the
    # step and its gradients) is what `pyparallel bench` prints next to the measurement: it must describe
    # both runs, not only bound them.
    for row in (single, zero3):
        print(f"{row['row']}: measured {row['peak_MiB']:.0f} MiB, predicted {row['predicted_MiB']:.0f} MiB")
        assert abs(row["predicted_MiB"] / row["peak_MiB"] - 1) <= 0.25, row


def test_a_flat_range_is_read_from_the_rows_it_covers(tmp_path):
    """A ZeRO shard is a flat range of a whole-tensor box: the reader asks the file for the rows that range
    touches (a quarter of an embedding per rank), not the whole tensor; any box and range gives the same data."""
    import torch
    from safetensors.torch import save_file

    from pyparallel.checkpoint.format import Piece
    from pyparallel.checkpoint.weights import WeightsReader

    t = torch.arange(7 * 5 * 3, dtype=torch.float32).view(7, 5, 3)
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    reader = WeightsReader(str(tmp_path / "w.safetensors"))
    asked = []
    handle = reader._handle(reader._files["w"])

    class Spy:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, index):
            asked.append(index)
            return self.sl[index]

    reader._handle = lambda file: type("H", (), {"get_slice": lambda self, k: Spy(handle.get_slice(k))})()
    for (o0, s0), (o1, s1) in [((0, 7), (0, 5)), ((2, 3), (1, 3)), ((6, 1), (0, 5))]:
        box = t[o0:o0 + s0, o1:o1 + s1]
        for a in range(0, box.numel() + 1, 4):
            for b in range(a, box.numel() + 1, 5):
                piece = Piece("model/w", (7, 5, 3), (o0, o1, 0), (s0, s1, 3), a, b - a)
                assert torch.equal(reader.piece(piece), box.reshape(-1)[a:b]), (o0, s0, o1, s1, a, b)
        piece = Piece("model/w", (7, 5, 3), (o0, o1, 0), (s0, s1, 3), 1, 4, perm=(2, 1, 0))
        assert torch.equal(reader.piece(piece), box.permute(2, 1, 0).reshape(-1)[1:5])
    asked.clear()
    reader.piece(Piece("model/w", (7, 5, 3), (0, 0, 0), (7, 5, 3), 2 * 15 + 4, 15))  # rows 2 and 3 only
    assert asked[0][0] == slice(2, 4)


def test_the_reader_keeps_no_mapping_of_the_file(tmp_path):
    """safetensors reads through a mapping of the file, whose touched pages count in the process's resident
    set while it lives: once a piece is copied and dropped, the reader holds no mapping (a reader that kept
    one handle per file held every page a rank had read for the model's lifetime: ~300 MiB on a 152.8M TP
    rank). Linux only (/proc/self/maps)."""
    import gc

    import pytest
    import torch
    from safetensors.torch import save_file

    from pyparallel.checkpoint.format import Piece
    from pyparallel.checkpoint.weights import WeightsReader

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps")
    path = str(tmp_path / "w.safetensors")
    t = torch.arange(64 * 1024, dtype=torch.float32).view(64, 1024)
    save_file({"w": t}, path)

    def mapped() -> bool:
        gc.collect()
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(path) for line in f)

    reader = WeightsReader(path)
    assert reader.shape("w") == (64, 1024) and not mapped()
    out = torch.empty(16, 512)
    out.view(-1).copy_(reader.piece(Piece("model/w", (64, 1024), (16, 512), (16, 512), 0, 16 * 512)))
    assert torch.equal(out, t[16:32, 512:]) and not mapped()
    full = reader.full("model/w")
    assert torch.equal(full, t)
    del full
    assert not mapped()
