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


class _Under:
    """Awaitable: awaits ``awaitable`` with pipeline ``p`` current during each of its steps (and
    whatever was current before it between steps, while the event loop runs other code)."""

    __slots__ = ("_p", "_awaitable")

    def __init__(self, p: Optional[Pipeline], awaitable: Any) -> None:
        self._p = p
        self._awaitable = awaitable

    def __await__(self) -> Any:
        p = self._p
        it = self._awaitable.__await__()
        send: Any = None
        error: Optional[BaseException] = None
        while True:
            try:
                with pipeline(p):
                    yielded = it.send(send) if error is None else it.throw(error)
            except StopIteration as stop:
                return stop.value
            send, error = None, None
            try:
                send = yield yielded
            except GeneratorExit:
                with pipeline(p):
                    it.close()
                raise
            except BaseException as e:  # thrown in by the event loop (cancellation): pass it on
                error = e


def _wrap_coroutine(p_of: Callable[[tuple], Optional[Pipeline]], fn: Callable[..., Any]) -> Any:
    """``async def`` ``fn`` whose body runs under ``p_of(args)`` across its awaits."""

    @functools.wraps(fn)
    async def coroutine_wrapper(*args: Any, **kwargs: Any) -> Any:
        p = p_of(args)
        return await _Under(p, fn(*args, **kwargs))

    return coroutine_wrapper


def _wrap_async_generator(p_of: Callable[[tuple], Optional[Pipeline]],
                          fn: Callable[..., Any]) -> Any:
    """Async generator function ``fn`` whose body runs under ``p_of(args)`` across its awaits
    and yields."""

    @functools.wraps(fn)
    async def async_generator_wrapper(*args: Any, **kwargs: Any) -> Any:
        p = p_of(args)
        agen = fn(*args, **kwargs)
        try:
            response = await _Under(p, agen.asend(None))
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    await _Under(p, agen.aclose())
                    raise
                except BaseException as e:
                    response = await _Under(p, agen.athrow(e))
                else:
                    response = await _Under(p, agen.asend(request))
        except StopAsyncIteration:
            return

    return async_generator_wrapper


def _decorate(p: Optional[Pipeline], fn: F) -> F:
    """``fn`` run under pipeline ``p`` (None: unchanged behaviour). What ``pipeline(p)(fn)`` and
    ``p(fn)`` return (the compiled Pipeline.__call__ calls it). Generators, ``async def``
    functions and async generators run under ``p`` in each of their steps, across yields and
    awaits."""
    if not callable(fn):
        raise TypeError(f"a pipeline decorator needs a callable, got {type(fn).__name__}")
    if inspect.isgeneratorfunction(fn):
        return _wrap_generator(p, fn)  # type: ignore[return-value]
    if inspect.iscoroutinefunction(fn):
        return _wrap_coroutine(lambda args: p, fn)  # type: ignore[no-any-return]
    if inspect.isasyncgenfunction(fn):
        return _wrap_async_generator(lambda args: p, fn)  # type: ignore[no-any-return]

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


def _check_takes_self(fn: Callable[..., Any]) -> None:
    """TypeError unless ``fn`` can take a first positional argument (``self``): bare
    ``@pipelined`` is for methods."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to check (a builtin): leave it to the call
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.VAR_POSITIONAL)
    if not params or params[0].kind not in positional:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"bare @torch_pipeline.pipelined runs a method under self.pipeline, but {name}() "
            f"takes no self argument. For a plain function, name the pipeline: "
            f"@torch_pipeline.pipelined(p) or @torch_pipeline.pipeline(p)"
        )


def _decorate_method(fn: F) -> F:
    if not callable(fn):
        raise TypeError(f"@pipelined needs a callable, got {type(fn).__name__}")
    _check_takes_self(fn)

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
    def pipeline_of_args(args: tuple) -> Optional[Pipeline]:
        if not args:
            raise TypeError(f"{fn.__qualname__}() missing its self argument")
        return pipeline_of(args[0])

    if inspect.iscoroutinefunction(fn):
        return _wrap_coroutine(pipeline_of_args, fn)  # type: ignore[no-any-return]
    if inspect.isasyncgenfunction(fn):
        return _wrap_async_generator(pipeline_of_args, fn)  # type: ignore[no-any-return]

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with pipeline(pipeline_of(self)):
            return fn(self, *args, **kwargs)

    return method  # type: ignore[return-value]


@overload
def pipelined(fn: F, /) -> F: ...
@overload
def pipelined(p: Optional[Pipeline] = ..., /) -> Callable[[F], F]: ...


def pipelined(arg: Any = _FROM_SELF) -> Any:
    """Decorator: run a function or method under a pipeline.

    * ``@tp.pipelined`` (or ``@tp.pipelined()``) on a method, e.g. ``nn.Module.forward``: runs it
      under ``self.pipeline``.
    * ``@tp.pipelined(p)``: runs the function under ``p`` (``None``: no pipeline change).

    Generator functions, ``async def`` functions and async generators run under the pipeline in
    every step of their body, across ``yield`` and ``await`` (the code the event loop runs in
    between keeps its own pipeline). Bare ``@tp.pipelined`` on a function that takes no ``self``
    is a TypeError.

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
