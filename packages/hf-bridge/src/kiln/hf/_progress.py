"""Training progress: one live bar on a terminal, plain lines every ``every`` steps otherwise."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


def duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``1h02m``."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Step, loss, eval loss, learning rate, gradient norm, tokens/s, elapsed time and ETA of a run of
    ``total`` steps starting after ``start``.

    The eval loss shows on the line of the step it was computed at; between evaluations a terminal's
    bar shows the last one with its step (``eval@40``), a log line none. Speeds count only the steps
    of this process (a resumed run does not average in the compile of the first step: the clock starts
    after it).
    """

    def __init__(self, total: int, *, start: int = 0, stream: TextIO | None = None, tty: bool | None = None,
                 every: int = 10) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.every = total, every
        self.step = start
        self.loss: float | None = None
        self.eval: tuple[int, float] | None = None  # the step of the last evaluation and its loss
        self.lr: float | None = None
        self.grad_norm: float | None = None
        self.elapsed: float | None = None
        self._t0: float | None = None
        self._counted = (start, 0.0)  # step and tokens when the clock started
        self._tokens = 0.0
        self._drawn = False

    def update(self, step: int, loss: float, tokens: float, eval_loss: float | None = None, *,
               lr: float | None = None, grad_norm: float | None = None, elapsed: float | None = None) -> None:
        """Step ``step`` is done; ``elapsed`` is the run's time so far (across resumptions)."""
        self.step, self.loss, self.lr, self.grad_norm, self.elapsed = step, loss, lr, grad_norm, elapsed
        if eval_loss is not None:
            self.eval = (step, eval_loss)
        self._tokens += tokens
        if self._t0 is None:  # the first step compiles: time from its end
            self._t0, self._counted = time.perf_counter(), (step, self._tokens)
        if self.tty:
            self._draw()
        elif step % self.every == 0 or step == self.total or eval_loss is not None:
            self._print(self.line())

    def rates(self) -> tuple[float | None, float | None]:
        """Tokens per second and seconds left, once two steps have run."""
        if self._t0 is None or self.step <= self._counted[0]:
            return None, None
        spent = time.perf_counter() - self._t0
        per_step = spent / (self.step - self._counted[0])
        return (self._tokens - self._counted[1]) / spent, per_step * (self.total - self.step)

    def line(self) -> str:
        width = len(str(self.total))
        parts = [f"step {self.step:>{width}}/{self.total}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval is not None and self.eval[0] == self.step:
            parts.append(f"eval {self.eval[1]:.4f}")
        elif self.eval is not None and self.tty:
            parts.append(f"eval@{self.eval[0]} {self.eval[1]:.4f}")
        if self.lr is not None:
            parts.append(f"lr {self.lr:.2e}")
        if self.grad_norm is not None:
            parts.append(f"grad {self.grad_norm:.3f}")
        speed, eta = self.rates()
        if speed is not None:
            parts.append(f"{speed:,.0f} tok/s")
        if self.elapsed is not None:
            parts.append(f"{duration(self.elapsed)} elapsed")
        if eta is not None:
            parts.append(f"ETA {duration(eta)}")
        return "  ".join(parts)

    def message(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
        self._print(text)
        if self.tty and self._drawn:
            self._draw()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self) -> None:
        text = self.line()
        cols = shutil.get_terminal_size((100, 20)).columns
        width = min(24, cols - len(text) - 5)
        if width >= 10:
            done = round(width * self.step / max(self.total, 1))
            text = f"[{'#' * done}{'.' * (width - done)}]  {text}"
        self.stream.write("\r\x1b[2K" + text[:cols - 1])
        self.stream.flush()
        self._drawn = True
