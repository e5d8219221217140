"""Non-reasoning SFT: the SFT set (data.py, formats.py), packing (packing.py), one optimizer step
(step.py) and the stage (train.py). See docs/models-and-sft.md, "SFT"."""
