"""A run that uses S3 credentials end to end, every logger at DEBUG, for ``tests/plugins/test_credentials.py``.

Credentials come from the standard places only, never from the command line: the AWS environment variables for
the ``Checkpointer`` part (and Lightning's own listing of ``default_root_dir``), ``storage_options`` (built from
``MDC_TEST_KEY`` / ``MDC_TEST_SECRET``, read here, as a user's own config code would) for the Lightning
``ObjectStoreCheckpointIO``. The test greps everything this run prints, every object it
stores and every local file it writes for the secrets. Usage::

    python -m tests.plugins._credentials_job ENDPOINT BUCKET OUTDIR
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import torch


def _checkpointer_part(endpoint: str, bucket: str) -> None:
    from multidc.plugins import Checkpointer, ModelState, RNGState

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    options = {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}  # keys: AWS_* env vars
    with Checkpointer(f"s3://{bucket}/plain", storage_options=options, keep_last_k=2) as ckpt:
        state = {"model": ModelState(model, optimizer), "rng": RNGState(), "trainer": {"step": 1, "lr": 1e-3}}
        ckpt.save(state, step=1, extra={"run": "credentials-test"})
        ckpt.save(state, step=2, async_save=True).wait()
        info = ckpt.load(state)
        print(f"loaded {info} from {ckpt.store!r}; listed {ckpt.list()}", flush=True)


def _lightning_part(endpoint: str, bucket: str, outdir: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from multidc.plugins import ObjectStoreCheckpointIO

    storage = {"endpoint_url": endpoint, "key": os.environ["MDC_TEST_KEY"], "secret": os.environ["MDC_TEST_SECRET"],
               "client_kwargs": {"region_name": "us-east-1"}}

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float = 0.1, storage: dict | None = None) -> None:
            super().__init__()
            # A user passing the store config to the module: hparams must not carry the secret.
            self.save_hyperparameters({"lr": lr, "checkpoint_url": f"s3://{bucket}/lightning"})
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, default_root_dir=f"s3://{bucket}/lightning",
                         plugins=[ObjectStoreCheckpointIO(storage_options=storage)],
                         logger=CSVLogger(os.path.join(outdir, "csv")), enable_progress_bar=False,
                         callbacks=[ModelCheckpoint(dirpath=f"s3://{bucket}/lightning", every_n_train_steps=1,
                                                    save_last=True)])
    trainer.fit(Tiny(storage=storage), data)
    print(f"lightning saved {trainer.checkpoint_callback.last_model_path}", flush=True)


def _wrong_credentials_part(endpoint: str, bucket: str) -> None:
    from multidc.plugins import Checkpointer

    options = {"endpoint_url": endpoint, "key": os.environ["MDC_TEST_KEY"],
               "secret": os.environ["MDC_TEST_WRONG_SECRET"], "client_kwargs": {"region_name": "us-east-1"}}
    try:
        Checkpointer(f"s3://{bucket}/wrong", storage_options=options).save({"w": torch.ones(2)}, step=1)
    except Exception as exc:
        print(f"WRONG-CREDENTIALS {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        raise  # uncaught: the interpreter prints the whole chain too


def main() -> int:
    endpoint, bucket, outdir = sys.argv[1:4]
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, force=True)
    torch.set_num_threads(1)
    _checkpointer_part(endpoint, bucket)
    _lightning_part(endpoint, bucket, outdir)
    _wrong_credentials_part(endpoint, bucket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
