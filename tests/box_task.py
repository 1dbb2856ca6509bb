"""A user's task and data set defined outside the package, whose targets are per-image dicts
of boxes of varying length (torchvision detection's layout):

    torchrun --standalone --nproc_per_node=2 train.py data=custom data._target_=box_task.boxes \\
        task=custom task._target_=box_task.BoxCount data.image_size=16 ...

The model (the tutorial's ConvNet, one output) counts the filled squares in an image."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric, SumMetric
from torchvision import tv_tensors

from ddp_utils.tasks import Task


class Squares(torch.utils.data.Dataset):
    """``n`` 16x16 grey images with 0 to 3 filled 4x4 squares each, and their boxes."""

    def __init__(self, n: int, seed: int, size: int = 16) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            k = int(torch.randint(0, 4, (), generator=g))
            image = torch.zeros(1, size, size, dtype=torch.uint8)
            xy = torch.randint(0, size - 4, (k, 2), generator=g)
            for x, y in xy.tolist():
                image[0, y : y + 4, x : x + 4] = 255
            boxes = tv_tensors.BoundingBoxes(torch.cat([xy, xy + 4], 1).float(), format="XYXY",
                                             canvas_size=(size, size))  # fmt: skip
            self.items.append((image, {"boxes": boxes, "labels": torch.ones(k, dtype=torch.long)}))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def boxes(n_train: int = 121, n_val: int = 50):
    return Squares(n_train, seed=0), Squares(n_val, seed=1)


class BoxCount(Task):
    """Regress the number of boxes of each image (MSE); metrics over images and boxes."""

    def num_outputs(self):
        return 1

    def metrics(self):
        return {"count_accuracy": MeanMetric(), "boxes": SumMetric(), "box_area": SumMetric()}

    def blank_target(self, n, size, device):
        return [{"boxes": torch.zeros(0, 4, device=device),
                 "labels": torch.zeros(0, dtype=torch.long, device=device)}] * n  # fmt: skip

    def step(self, model, batch):
        pred = model(batch.inputs).float().squeeze(1)
        counts = torch.tensor([len(t.get("boxes", ())) for t in batch.target], device=pred.device)
        error = torch.where(batch.real, (pred - counts) ** 2, 0.0)
        return pred, counts, error.sum(), batch.count()

    def train_loss(self, model, batch):
        return self.step(model, batch)[2:]

    def eval_step(self, model, batch, metrics):
        pred, counts, loss_sum, count = self.step(model, batch)
        pred, counts, targets = batch.select(pred), batch.select(counts), batch.select(batch.target)
        metrics["count_accuracy"].update((pred.round() == counts).float())
        metrics["boxes"].update(counts.sum().float())
        area = sum(float(((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).sum()) for b in
                   (t["boxes"] for t in targets))  # fmt: skip
        metrics["box_area"].update(torch.tensor(area, device=pred.device))
        return loss_sum, count
