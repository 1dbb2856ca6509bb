"""The evaluation's numbers are the same at any world size, to the last digit: canonical
batches dealt to the ranks, their results joined in batch order (``BatchOrder``), in real gloo
groups of 2 and 3 on a prime-sized set, for float sums (a mean, perplexity, the loss), the
scores a metric keeps (AUROC), counts and maxima."""

from __future__ import annotations

import pytest
import torch
from helpers.launch import in_gloo_group
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC
from torchmetrics.text import Perplexity

from ddp_utils.data.samplers import EvalShardSampler
from ddp_utils.evaluation import BatchOrder

N, BATCH, CLASSES = 101, 8, 5  # 13 batches, the last of 5


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, CLASSES, generator=g) * 3
    target = torch.randint(0, CLASSES, (N,), generator=g)
    tokens = torch.randn(N, 7, CLASSES, generator=g)  # a language model's 7 positions
    return logits, target, tokens


def metrics() -> MetricCollection:
    return MetricCollection(
        {
            "mean": MeanMetric(),  # float sums: the value and its weight
            "max": MaxMetric(),
            "accuracy": MulticlassAccuracy(CLASSES, average="micro"),  # integer counts
            "auroc": MulticlassAUROC(CLASSES),  # every sample's scores, a list
            "perplexity": Perplexity(),  # a float sum of log-probabilities and a count
        },
        compute_groups=False,
    )


def evaluate(rank: int, world: int) -> dict:
    logits, target, tokens = data()
    collection, order = metrics(), None
    order = BatchOrder(collection)
    for k in EvalShardSampler(N, world, rank, BATCH).batches():
        rows = slice(k * BATCH, (k + 1) * BATCH)
        order.start_batch()
        loss = torch.nn.functional.cross_entropy(logits[rows], target[rows], reduction="sum")
        collection["mean"].update(logits[rows].softmax(1)[:, 0] * 1e3)
        collection["max"].update(logits[rows].max())
        collection["accuracy"].update(logits[rows], target[rows])
        collection["auroc"].update(logits[rows].softmax(1), target[rows])
        collection["perplexity"].update(tokens[rows], tokens[rows].argmax(-1).roll(1, 0))
        n = torch.tensor(float(len(target[rows])))
        order.end_batch(k, torch.stack([loss.double(), n.double(), n * 0, n.double()]))
    totals = order.join(world).tolist()
    result = {k: v.tolist() for k, v in order.compute(collection).items()}
    return result | {"loss": totals[0] / totals[1], "samples": totals[3]}


@pytest.mark.parametrize("world", [2, 3])
def test_every_metric_equals_world_size_1s_to_the_last_digit(world, tmp_path):
    alone = evaluate(0, 1)
    assert alone["samples"] == N
    assert in_gloo_group(evaluate, world, tmp_path) == alone


def test_world_size_1_is_torchmetrics_own_number():
    """Joined in batch order, one process computes what plain accumulation computes."""
    logits, target, tokens = data()
    plain = metrics()
    for k in range(-(-N // BATCH)):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        plain["mean"].update(logits[rows].softmax(1)[:, 0] * 1e3)
        plain["max"].update(logits[rows].max())
        plain["accuracy"].update(logits[rows], target[rows])
        plain["auroc"].update(logits[rows].softmax(1), target[rows])
        plain["perplexity"].update(tokens[rows], tokens[rows].argmax(-1).roll(1, 0))
    expected = {k: v.tolist() for k, v in plain.compute().items()}
    got = evaluate(0, 1)
    assert {k: got[k] for k in expected} == expected


def test_a_metric_of_another_reduction_is_left_to_torchmetrics_sync():
    class Averaged(MeanMetric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("spread", torch.tensor(0.0), dist_reduce_fx="mean")

    collection = MetricCollection({"a": Averaged(), "b": MeanMetric()}, compute_groups=False)
    order = BatchOrder(collection)
    assert [type(m) for m in order.own_sync] == [Averaged]
    assert {attr for _, attr in order.ordered} == {"mean_value", "weight"}
