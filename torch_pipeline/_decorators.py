"""Running functions under a pipeline: ``@p`` / ``@tp.pipeline(p)`` and ``@tp.pipelined``."""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional, TypeVar, overload

from . import _C
from ._C import Pipeline, pipeline

__all__ = ["pipelined"]

F = TypeVar("F", bound=Callable[..., Any])


def _wrap_generator(p: Optional[Pipeline], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def generator_wrapper(*args: Any, **kwargs: Any) -> Any:
        with pipeline(p):
            gen = fn(*args, **kwargs)
        try:
            with pipeline(p):
                response = gen.send(None)
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    with pipeline(p):
                        gen.close()
                    raise
                except BaseException:
                    with pipeline(p):
                        response = gen.throw(*sys.exc_info())
                else:
                    with pipeline(p):
                        response = gen.send(request)
        except StopIteration as stop:
            return stop.value

    return generator_wrapper


def _decorate(p: Optional[Pipeline], fn: F) -> F:
    """``fn`` run under pipeline ``p`` (None: unchanged behaviour). What ``pipeline(p)(fn)`` and
    ``p(fn)`` return (the compiled Pipeline.__call__ calls it)."""
    if not callable(fn):
        raise TypeError(f"a pipeline decorator needs a callable, got {type(fn).__name__}")
    if inspect.isgeneratorfunction(fn):
        return _wrap_generator(p, fn)  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with pipeline(p):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_C._set_decorate(_decorate)


class _FromSelf:
    def __repr__(self) -> str:
        return "<self.pipeline>"


_FROM_SELF = _FromSelf()


def _decorate_method(fn: F) -> F:
    if not callable(fn):
        raise TypeError(f"@pipelined needs a callable, got {type(fn).__name__}")

    def pipeline_of(self: Any) -> Optional[Pipeline]:
        try:
            p = self.pipeline
        except AttributeError:
            raise AttributeError(
                f"@torch_pipeline.pipelined runs {fn.__qualname__} under self.pipeline, but "
                f"{type(self).__name__} has no attribute 'pipeline': set self.pipeline = "
                f"torch_pipeline.Pipeline() in __init__, or use @torch_pipeline.pipelined(p)"
            ) from None
        if p is not None and not isinstance(p, Pipeline):
            raise TypeError(
                f"{type(self).__name__}.pipeline must be a torch_pipeline.Pipeline or None, got "
                f"{type(p).__name__}"
            )
        return p

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return (yield from _wrap_generator(pipeline_of(self), fn)(self, *args, **kwargs))

        return generator_method  # type: ignore[return-value]

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with pipeline(pipeline_of(self)):
            return fn(self, *args, **kwargs)

    return method  # type: ignore[return-value]


@overload
def pipelined(fn: F) -> F: ...
@overload
def pipelined(p: Optional[Pipeline] = ...) -> Callable[[F], F]: ...


def pipelined(arg: Any = _FROM_SELF) -> Any:
    """Decorator: run a function or method under a pipeline.

    * ``@tp.pipelined`` (or ``@tp.pipelined()``) on a method, e.g. ``nn.Module.forward``: runs it
      under ``self.pipeline``.
    * ``@tp.pipelined(p)``: runs the function under ``p`` (``None``: no pipeline change).

        >>> class Branch(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.pipeline = tp.Pipeline()
        ...         self.lin = torch.nn.Linear(4, 4)
        ...     @tp.pipelined
        ...     def forward(self, x):
        ...         return self.lin(x)
    """
    if arg is _FROM_SELF:
        return _decorate_method
    if isinstance(arg, Pipeline) or arg is None:
        return functools.partial(_decorate, arg)
    if callable(arg):
        return _decorate_method(arg)
    raise TypeError(
        f"pipelined expects a torch_pipeline.Pipeline, None, or a function to decorate, got "
        f"{type(arg).__name__}"
    )
