"""The train stage: EAGLE-3 drafter training with training-time test (see trainer.py)."""
from .trainer import check_train_settings, finetune_source, run_train

__all__ = ["check_train_settings", "finetune_source", "run_train"]
