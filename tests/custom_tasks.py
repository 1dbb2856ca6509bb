"""docs/extend/task.md's custom task: task=custom task._target_=custom_tasks.DigitValue."""

import torch
from torchmetrics import MeanAbsoluteError

from ddp_utils.tasks import Task


class DigitValue(Task):
    """Regress a digit's value (0-9) with MSE, from a model with one output."""

    def num_outputs(self):
        return 1

    def metrics(self):
        return {"mae": MeanAbsoluteError()}

    def step(self, model, batch):
        pred = model(batch.inputs).float().squeeze(1)
        error = torch.where(batch.real, (pred - batch.target.float()) ** 2, 0.0)
        return pred, error.sum(), batch.count()

    def train_loss(self, model, batch):
        return self.step(model, batch)[1:]

    def eval_step(self, model, batch, metrics):
        pred, loss_sum, count = self.step(model, batch)
        metrics.update(batch.select(pred), batch.select(batch.target).float())
        return loss_sum, count


class NoEvalStep(Task):
    """A task that forgot eval_step: refused before training."""

    def train_loss(self, model, batch):
        return model(batch.inputs).sum(), batch.count()


class PerSampleLoss(DigitValue):
    """Returns a loss per sample (a vector), not their sum: refused before training."""

    def train_loss(self, model, batch):
        pred = model(batch.inputs).float().squeeze(1)
        return (pred - batch.target.float()) ** 2, batch.count()


class NoCount(DigitValue):
    """Returns the loss alone, without the count of real rows: refused before training."""

    def train_loss(self, model, batch):
        return self.step(model, batch)[1]


class MeanLoss(DigitValue):
    """Returns the batch mean where the sum is expected: refused before training."""

    def train_loss(self, model, batch):
        _, loss_sum, count = self.step(model, batch)
        return loss_sum / count, count

    def eval_step(self, model, batch, metrics):
        pred, loss_sum, count = self.step(model, batch)
        metrics.update(batch.select(pred), batch.select(batch.target).float())
        return loss_sum / count, count
