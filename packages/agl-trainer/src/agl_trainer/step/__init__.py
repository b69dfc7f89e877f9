"""The stages of one training step, in the order a batch moves through them (see ``trainer.fit``)."""
