"""eyas: train EAGLE-3 speculative-decoding drafters for a target LLM and prove what they are worth."""
__version__ = "0.1.0"
