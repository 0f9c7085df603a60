"""Running a model: the one definition of each step (`steps`), the run's configuration (`config`), the training loop
(`loop`), data (`data`), checkpoints (`checkpoint`), metrics (`metrics`) and the run directory's lock (`lock`)."""
