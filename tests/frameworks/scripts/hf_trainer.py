"""A tiny random-init GPT-2 under transformers' Trainer (accelerate underneath)."""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tests.frameworks.scripts import common

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
model = GPT2LMHeadModel(config)
common.poison(model.transformer.h[1].mlp)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Watch(TrainerCallback):
    """MODE=explicit: watch() from a callback, given the Trainer's (wrapped) optimizer."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import breakpod

        breakpod.watch(model, common.PARK_RULES, optimizer=optimizer)


args = TrainingArguments(
    output_dir=common.os.environ.get("OUT") or tempfile.mkdtemp(prefix="hf-out-"),  # not the cwd
    max_steps=common.STEPS,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    use_cpu=True,
    bf16=common.os.environ.get("BF16") == "1",  # CPU autocast
    gradient_accumulation_steps=int(common.os.environ.get("ACCUMULATE", "1")),
    dataloader_num_workers=0,
    disable_tqdm=True,
)
callbacks = [Watch()] if common.EXPLICIT else []
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
trainer.train()
common.finish(model)
