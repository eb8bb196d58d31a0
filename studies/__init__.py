"""Studies that train, adapt and grade models per event to answer a question about the method
(the leave-one-event-out few-shot report, a new tile of a known event), on top of ``app`` and
``local_damage``; reached from the command line as ``local-damage bench fewshot`` and
``local-damage bench new-tile``."""
