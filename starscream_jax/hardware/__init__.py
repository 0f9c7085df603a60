"""The machine: the mesh's axis names (`axes`), hardware presets (`presets`), the gpu x xcd topology (`topology`),
ROCm detection from KFD sysfs and amd-smi (`detect`), simulated CPU devices (`simulation`), joining processes
(`distributed`) and the mesh builder (`mesh`: physical-GPU grouping -> a ('data', 'gpu', 'xcd') Mesh)."""
