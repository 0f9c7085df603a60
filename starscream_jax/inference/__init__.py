"""Running a trained model for inference outside the server: loading it (`loading`: a checkpoint or a Hugging Face
directory, placed, in the weight and cache formats asked for, with its tokenizer) and generating from a batch of
prompts (`generate`: prefill under one layout, decode under another)."""
