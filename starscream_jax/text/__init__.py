"""Text and its tokens: the tokenizers (`tokenizer`: a model directory's tokenizer.json with its chat template, or the
byte-level one of `byte_level`) and training text read from files (`corpus`: tokenized once, cached, packed)."""
