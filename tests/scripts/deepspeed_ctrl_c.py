"""A Ctrl-C under DeepSpeed (one process) right after the last micro-batch of step 2, whose backward has applied the
update (DeepSpeed steps inside ``accelerator.backward``, before the optimizer hooks), then the command's own
interruption save. Writes ``result.json`` (the checkpoints saved, the saved step, and whether the checkpoint's weights
are the model's). Used by tests/test_resume.py under ``accelerate launch`` with recipes/accelerate/zero2.yaml:
``... tests/scripts/deepspeed_ctrl_c.py MODEL OUT``."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from conftest import TRAINER_TEST_SETTINGS, make_prompt_dataset, parity_reward  # noqa: E402

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402
from egpo_trl.script.resume import save_interrupted  # noqa: E402


def main(model_dir: str, out_dir: str) -> None:
    settings = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "bf16": False,
        "save_strategy": "no",
        "model_init_kwargs": {"attn_implementation": "eager"},
        "use_cpu": not torch.cuda.is_available(),
    }
    args = EGPOConfig(output_dir=out_dir, **{**TRAINER_TEST_SETTINGS, **settings})
    trainer = EGPOTrainer(model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    training_step = trainer.training_step
    sent = []

    def interrupted(*pos, **kwargs):
        loss = training_step(*pos, **kwargs)
        if trainer.state.global_step == 1 and trainer.accelerator.sync_gradients and not sent:
            sent.append(int(trainer.model_wrapped.global_steps))  # the engine has stepped: 2 updates
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    trainer.training_step = interrupted
    try:
        trainer.train()
        stopped = False
    except KeyboardInterrupt:
        stopped = True
        save_interrupted(trainer)
    checkpoints = sorted(p.name for p in Path(out_dir).glob("checkpoint-*"))
    result = {"stopped": stopped, "engine_steps_at_ctrl_c": sent, "checkpoints": checkpoints}
    if checkpoints:
        from safetensors.torch import load_file

        folder = Path(out_dir, checkpoints[-1])
        result["saved_step"] = json.loads((folder / "trainer_state.json").read_text())["global_step"]
        saved = load_file(str(folder / "model.safetensors"))
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped).state_dict()
        result["weights_are_the_models"] = all(
            torch.equal(saved[name], model[name].detach().cpu()) for name in saved if name in model
        ) and bool(set(saved) & set(model))
    Path(out_dir, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
