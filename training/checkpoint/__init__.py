"""Checkpoints, a file a job: ``layout`` (step folders, the newest, the state split into safetensors tensors and
JSON, the model record a resume compares), ``saver`` (saves, in the step or in the background), ``restore``
(loads: the newest checkpoint a job trusts), ``seal`` (which checkpoints those are), ``store`` (a checkpoint
folder on object storage) and ``export`` (the consolidated ``hf/`` export). ``headrace.training.train`` calls one
save (``saver.Saver.save``) and one load (``restore.load_newest``)."""
