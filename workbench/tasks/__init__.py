"""What a model can be exported as: the task registry (each task's graph inputs and outputs, how its head runs, its
served score) and the choice `task=auto` makes from a model's folder. The bottom room: it imports no other."""
