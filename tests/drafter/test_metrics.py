import torch

from dflash.drafter.metrics import add, count, finalize, streaks, tau_histogram


def test_streak_stops_at_first_miss_or_missing_label():
    pred = torch.tensor([[9, 1, 2, 3, 4], [9, 1, 0, 3, 4], [9, 1, 2, 3, 4]])
    labels = torch.tensor([[0, 1, 2, 3, 4]] * 3)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    c = count(pred, labels, mask)
    assert c["blocks"] == 3 and c["streak"] == 4 + 1 + 2
    m = finalize(c, "eval")
    assert m["eval/acc@1"] == 1.0 and m["eval/acc@2"] == 2 / 3 and m["eval/acc@4"] == 1.0
    assert abs(m["eval/tau"] - (7 / 3 + 1)) < 1e-12


def test_counts_add_up_over_batches():
    pred = torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    total = add(add(None, count(pred, pred, mask)), count(pred, pred * 0, mask))
    assert finalize(total, "x")["x/streak"] == 1.0


def test_streaks_and_histogram():
    assert streaks(torch.tensor([[True, True, False, True]])).tolist() == [2]
    assert tau_histogram([1, 3, 3, 4], 4) == [1, 0, 2, 1]
