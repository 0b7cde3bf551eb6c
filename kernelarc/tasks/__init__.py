"""Tasks in the SOL-ExecBench format: loading, validation, inputs."""

from kernelarc.tasks.loader import Task, TaskError, builtin_tasks, load_builtin, load_task, resolve_axes

__all__ = ["Task", "TaskError", "builtin_tasks", "load_builtin", "load_task", "resolve_axes"]
