"""What comes in and goes out of a run: checkpoints (weights, checkpoint_config), run inputs
(inputs, text, image), outputs (outputs) and the file checks they share (files)."""
