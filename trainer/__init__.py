"""The local side of a peer: model and tokenizer, data, and the training loop."""
