"""Data sets, conversations, tokenization and regeneration."""
from .conversation import Conversation, Turn
from .readers import ReadReport, read_dataset, select_split, split_of

__all__ = ["Conversation", "Turn", "ReadReport", "read_dataset", "select_split", "split_of"]
