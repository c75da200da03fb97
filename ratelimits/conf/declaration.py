"""How a setting of ``settings.RATELIMITS`` is declared, and how the project's value is read.

A setting is a :class:`Setting`, a class attribute of the :class:`Namespace` it belongs to (its
key is the attribute's name in upper case); a namespace sits in its parent by a :class:`Mount`.
The root, a :class:`Root`, is ``RATELIMITS`` itself: it finds each setting's value in the
project's dict (under its name, or the name 0.1 gave it), parses it once, and says what the
checks should know about how the dict is written (:meth:`Root.findings`). The settings
themselves are declared in :mod:`ratelimits.conf`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Generic, TypeVar, cast, overload

from django.conf import settings as django_settings

from ..exceptions import ConfigurationError

__all__ = [
    "OLD_NAMES_UNTIL",
    "Finding",
    "KeyPath",
    "Mount",
    "Namespace",
    "Root",
    "Setting",
    "Switchable",
    "field_of",
    "reference",
]

T = TypeVar("T")
N = TypeVar("N", bound="Namespace")
#: Where a value lives in ``RATELIMITS``: its keys, outermost first (``("REDIS", "URL")``).
KeyPath = tuple[str, ...]
#: The release that stops reading the names settings had in 0.1.
OLD_NAMES_UNTIL = "0.3"


def field_of(path: KeyPath) -> str:
    """How messages name a place in the settings: ``RATELIMITS['REDIS']['URL']``."""
    return "RATELIMITS" + "".join(f"[{key!r}]" for key in path)


#: A key not given in the project's settings.
_MISSING: Any = object()


class Setting(Generic[T]):
    """One setting: its key, default, parser, check id and documentation line.

    Declared as a class attribute of its :class:`Namespace`; read on the namespace's instance
    (``conf.redis.url``), it parses the project's value once and keeps the result in the instance,
    where it is a plain attribute until :meth:`Settings.clear`.
    """

    def __init__(
        self,
        default: Any,
        parser: Callable[[Any, str], T],
        *,
        id: str,
        doc: str,
        old: str | KeyPath | None = None,
        key: str | None = None,
        shown: str | None = None,
        derive: Callable[[Root], Any] | None = None,
        after: Callable[[Any, T], T] | None = None,
    ) -> None:
        self.default = default
        #: ``(value, field) -> parsed``; raises :class:`ConfigurationError` naming ``field``.
        self.parser = parser
        #: The system check id an invalid value is reported under.
        self.id = id
        #: One line of Markdown for docs/configuration.md.
        self.doc = doc
        #: Where 0.1 read it (a top-level key, or a path): still read there until 0.3.
        self.old: KeyPath | None = (old,) if isinstance(old, str) else old
        self._key = key
        #: The default as docs/configuration.md shows it, when its ``repr`` would not say it well.
        self.shown = shown
        #: A default computed from other settings (``conf`` -> the value to parse) instead of ``default``.
        self.derive = derive
        #: ``(namespace, parsed) -> parsed``: a rule across settings (the namespace gives the others).
        self.after = after
        self.attr = ""
        #: Set when the namespaces are mounted (``_mount``): ``("REDIS", "URL")``, and its namespace.
        self.path: KeyPath = ()
        self.namespace: type[Namespace] | None = None

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @property
    def key(self) -> str:
        """Its key in its namespace: the attribute's name in upper case, unless declared otherwise."""
        return self._key or self.attr.upper()

    @property
    def name(self) -> str:
        """Its path joined by dots (``"REDIS.URL"``): what :attr:`ConfigurationError.setting` carries."""
        return ".".join(self.path)

    @property
    def field(self) -> str:
        return field_of(self.path)

    def parse(self, value: Any) -> T:
        try:
            return self.parser(value, self.field)
        except ConfigurationError as exc:
            raise ConfigurationError(str(exc), setting=self.name) from None

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, instance: Namespace, owner: type) -> T: ...

    def __get__(self, instance: Namespace | None, owner: type) -> Setting[T] | T:
        if instance is None:
            return self
        generation = instance._conf.generation
        value = instance._conf.value(self)
        if self.after is not None:
            try:
                value = self.after(instance, value)
            except ConfigurationError as exc:
                raise ConfigurationError(str(exc), setting=exc.setting or self.name) from None
        if instance._keeps(generation):
            instance.__dict__[self.attr] = value  # a plain attribute from now on, until Root.clear()
        return value


class Mount(Generic[N]):
    """A namespace inside another (``REDIS`` inside ``RATELIMITS``): read, it is the namespace's instance."""

    def __init__(self, namespace: type[N]) -> None:
        self.namespace = namespace
        self.attr = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @property
    def key(self) -> str:
        return self.attr.upper()

    @overload
    def __get__(self, instance: None, owner: type) -> Mount[N]: ...

    @overload
    def __get__(self, instance: Namespace, owner: type) -> N: ...

    def __get__(self, instance: Namespace | None, owner: type) -> Mount[N] | N:
        if instance is None:
            return self
        generation = instance._conf.generation
        namespace = self.namespace(instance._conf)
        if instance._keeps(generation):
            instance.__dict__[self.attr] = namespace
        return namespace


class Namespace:
    """A group of settings under one key of ``RATELIMITS`` (the root, :class:`Settings`, is ``RATELIMITS``)."""

    #: Its keys (``()`` for the root), set when mounted.
    path: ClassVar[KeyPath] = ()
    #: The attributes that lead to it from :data:`conf` (``("shedding", "adaptive")``), set when mounted.
    attrs: ClassVar[tuple[str, ...]] = ()
    #: The check id a value of the wrong shape is reported under (not a dict, say).
    id: ClassVar[str] = "ratelimits.E003"
    #: One line of Markdown for docs/configuration.md.
    doc: ClassVar[str] = ""
    #: A feature that can be switched off: its value may also be ``True`` (on, with the defaults) or
    #: ``False`` (off); ``switch`` is whether it is on when not given. ``None``: always on.
    switch: ClassVar[bool | None] = None
    #: Where 0.1 turned the feature on (``ADAPTIVE_CAPACITY``): a value there switches it on.
    old: ClassVar[KeyPath | None] = None
    #: The setting 0.1 wrote where the namespace now is (``HEADERS = "both"`` for ``STYLE``): a value
    #: of another shape is read as that setting.
    legacy: ClassVar[str | None] = None
    #: Whether 0.1 wrote that setting as a dict too, so a dict with none of the namespace's keys is
    #: read as it (``REGIONS = {"eu": {...}}``).
    legacy_mapping: ClassVar[bool] = False

    def __init__(self, owner: Root) -> None:
        self._conf = owner
        #: The settings' generation this instance reads (see :meth:`Root.clear`).
        self._born = owner.generation if owner is not self else 0

    def _keeps(self, generation: int) -> bool:
        """Whether a value read at ``generation`` may be kept here: the settings have not changed
        since, and this instance is still the one :data:`conf` reads."""
        return self._conf.generation == generation == self._born

    @classmethod
    def declared(cls) -> Iterator[Setting[Any]]:
        """Its own settings, in the order they are declared."""
        for value in vars(cls).values():
            if isinstance(value, Setting):
                yield value

    @classmethod
    def namespaces(cls) -> Iterator[type[Namespace]]:
        """The namespaces inside it, in the order they are declared."""
        for value in vars(cls).values():
            if isinstance(value, Mount):
                yield value.namespace

    @classmethod
    def keys(cls) -> set[str]:
        return {s.key for s in cls.declared()} | {n.path[-1] for n in cls.namespaces()}

    @classmethod
    def name(cls) -> str:
        return ".".join(cls.path)

    @classmethod
    def field(cls) -> str:
        return field_of(cls.path)

    @classmethod
    def _mount(cls, path: KeyPath, attrs: tuple[str, ...]) -> None:
        cls.path, cls.attrs = path, attrs
        for setting in cls.declared():
            setting.path = (*path, setting.key)
            setting.namespace = cls
        for value in vars(cls).values():
            if isinstance(value, Mount):
                value.namespace._mount((*path, value.key), (*attrs, value.attr))

    def values(self) -> dict[str, Any]:
        """Every setting of this namespace, parsed, by attribute name."""
        return {setting.attr: getattr(self, setting.attr) for setting in self.declared()}


class Switchable(Namespace):
    """A feature that can be switched off: ``True`` (on, with its defaults), ``False``, or a dict (on)."""

    switch: ClassVar[bool | None] = False

    @cached_property
    def enabled(self) -> bool:
        """Whether the feature is on."""
        return self._conf.switched_on(type(self))


@dataclass(frozen=True, slots=True)
class Finding:
    """What :meth:`Settings.findings` tells the checks about how ``RATELIMITS`` is written."""

    #: ``"unknown"`` (a key that is no setting), ``"renamed"`` (a 0.1 name) or ``"both"`` (old and new).
    kind: str
    message: str
    hint: str | None = None


class Root(Namespace):
    """``RATELIMITS`` itself: typed, validated, cached access to ``settings.RATELIMITS`` for every
    setting declared under it. Its subclass declares the top level (:class:`ratelimits.conf.Settings`)."""

    #: Every namespace by its path, every setting by its name, and the keys and dicts 0.1 had:
    #: made by :meth:`mount`, once the namespaces are declared.
    by_path: ClassVar[dict[KeyPath, type[Namespace]]] = {}
    by_name: ClassVar[dict[str, Setting[Any]]] = {}
    old_keys: ClassVar[dict[KeyPath, set[str]]] = {}
    old_containers: ClassVar[set[KeyPath]] = set()

    @classmethod
    def mount(cls) -> None:
        """Give every namespace and setting under this root its path, and index them."""
        cls._mount((), ())
        cls.by_path = {namespace.path: namespace for namespace in _every(cls)}
        cls.by_name = {setting.name: setting for namespace in _every(cls) for setting in namespace.declared()}
        cls.old_keys = {}
        olds = [s.old for s in cls.by_name.values() if s.old] + [n.old for n in cls.by_path.values() if n.old]
        for path in olds:
            for depth in range(len(path)):
                cls.old_keys.setdefault(path[:depth], set()).add(path[depth])
        # Dicts 0.1 had that are no namespace now (RECONCILE, ADAPTIVE_CAPACITY): their keys are checked too.
        cls.old_containers = {path for path in cls.old_keys if path and path not in cls.by_path}

    def __init__(self) -> None:
        #: Moved on by every :meth:`clear`: a value read before it is never kept after it.
        self.generation = 0
        super().__init__(self)
        self._values: dict[str, Any] = {}

    def _keeps(self, generation: int) -> bool:
        return self.generation == generation

    # -- reading the project's settings --------------------------------------------------------

    def clear(self) -> None:
        """Forget every parsed value: the next read parses the settings afresh.

        A thread that read a value before this and keeps it after would keep a value of the old
        settings: the generation moves first, and a value read at another generation is not kept.
        """
        self.generation += 1
        self._values.clear()
        # The namespaces and the values read through them are plain attributes of the instances.
        for name in list(self.__dict__):
            if name not in ("_values", "_conf", "_born", "generation"):
                self.__dict__.pop(name, None)

    @property
    def user_settings(self) -> Mapping[str, Any]:
        """``settings.RATELIMITS`` as the project wrote it (a dict, or a :class:`ConfigurationError`)."""
        value = getattr(django_settings, "RATELIMITS", {})
        if not isinstance(value, dict):
            raise ConfigurationError(f"RATELIMITS must be a dict, got {type(value).__name__}")
        return value

    def value(self, setting: Setting[T]) -> T:
        """The parsed value of ``setting``; raises :class:`ConfigurationError` naming it if invalid."""
        try:
            return cast(T, self._values[setting.name])
        except KeyError:
            pass
        generation = self.generation
        try:
            found = self.given(setting)
        except ConfigurationError as exc:  # a namespace on its way is not a dict
            raise ConfigurationError(str(exc), setting=exc.setting or setting.name) from None
        if found is not None:
            raw = found[0]
        elif setting.derive is not None:
            raw = setting.derive(self)
        else:
            raw = setting.default
        parsed = setting.parse(raw)
        if self.generation == generation:
            self._values[setting.name] = parsed
        return parsed

    def read(self, setting: Setting[T]) -> T:
        """``setting`` read as the code reads it (``conf.redis.url``): parsed, and checked against the others."""
        owner: Any = self
        for attr in setting.namespace.attrs if setting.namespace is not None else ():
            owner = getattr(owner, attr)
        return cast(T, getattr(owner, setting.attr))

    def namespace(self, namespace: type[N]) -> N:
        """The instance of ``namespace`` that :data:`conf` reads (``conf.shedding.adaptive``)."""
        owner: Any = self
        for attr in namespace.attrs:
            owner = getattr(owner, attr)
        return cast(N, owner)

    def is_set(self, setting: Setting[Any]) -> bool:
        """Whether the project sets ``setting`` itself (under its name, or its 0.1 name), rather than its default."""
        return self.given(setting) is not None

    def given(self, setting: Setting[Any]) -> tuple[Any, KeyPath] | None:
        """The project's value of ``setting`` and where it was written, or ``None`` if it gives none."""
        found = self._at(setting.path)
        if found is not _MISSING:
            return found, setting.path
        namespace = setting.path[:-1]
        container = self._at(namespace) if namespace else _MISSING
        if (
            container is not _MISSING
            and self._legacy_of(namespace) == setting.attr
            and self._is_legacy(namespace, container)
        ):
            return container, namespace
        if setting.old is not None:
            found = self._at(setting.old)
            if found is not _MISSING:
                return found, setting.old
        return None

    def switched_on(self, namespace: type[Namespace]) -> bool:
        """Whether a switchable namespace is on: its value, else its 0.1 name's presence, else its default."""
        if namespace.switch is None:
            return True
        value = self._at(namespace.path)
        if value is _MISSING and namespace.old is not None:
            old = self._at(namespace.old)
            value = _MISSING if old is _MISSING or old is None else old is not False
        if value is _MISSING:
            return namespace.switch
        if value is not None and not isinstance(value, (bool, Mapping)):
            raise ConfigurationError(
                f"{namespace.field()}: expected True, False or a dict, got {value!r}", setting=namespace.name()
            )
        return value is not None and value is not False

    def _at(self, path: KeyPath) -> Any:
        """The project's value at ``path``, or ``_MISSING``. A namespace on the way that is neither a
        dict nor one of its accepted shorthands is an error naming it."""
        value: Any = self.user_settings
        for depth, key in enumerate(path):
            if not isinstance(value, Mapping):
                prefix = path[:depth]
                if self._shorthand(prefix, value):
                    return _MISSING
                namespace = self.by_path.get(prefix)
                expected = (
                    "True, False or a dict" if namespace is not None and namespace.switch is not None else "a dict"
                )
                raise ConfigurationError(
                    f"{field_of(prefix)}: expected {expected}, got {value!r}",
                    setting=namespace.name() if namespace is not None else None,
                )
            value = value.get(key, _MISSING)
            if value is _MISSING:
                return _MISSING
        return value

    def _shorthand(self, path: KeyPath, value: Any) -> bool:
        """Whether ``value`` at a namespace's ``path`` stands for something other than its dict of settings."""
        namespace = self.by_path.get(path)
        if namespace is None:  # a 0.1 dict that switched a feature (ADAPTIVE_CAPACITY): None or a bool switches it
            return path in self.old_containers and (value is None or isinstance(value, bool))
        if namespace.switch is not None and (value is None or isinstance(value, bool)):
            return True
        return namespace.legacy is not None and self._is_legacy(path, value)

    def _legacy_of(self, path: KeyPath) -> str | None:
        namespace = self.by_path.get(path)
        return namespace.legacy if namespace is not None else None

    def _is_legacy(self, path: KeyPath, value: Any) -> bool:
        """Whether a namespace's value is written as 0.1 wrote the setting it replaced (``HEADERS = "both"``)."""
        namespace = self.by_path.get(path)
        if namespace is None or namespace.legacy is None:
            return False
        if not isinstance(value, Mapping):
            return True
        return namespace.legacy_mapping and bool(value) and not set(value) & namespace.keys()

    # -- what the checks report about the way RATELIMITS is written ----------------------------

    def findings(self) -> list[Finding]:
        """Keys that are no setting, settings under their 0.1 names, and settings given under both names."""
        found: list[Finding] = []
        self._unknown_keys((), self.user_settings, found)
        for setting in self.by_name.values():
            new = self._at_quietly(setting.path)
            try:
                where = self.given(setting)
            except ConfigurationError:
                continue  # a namespace of the wrong shape: reported as an invalid value
            if where is None or where[1] == setting.path:
                if new is not _MISSING and setting.old is not None and self._at_quietly(setting.old) is not _MISSING:
                    found.append(
                        Finding(
                            "both",
                            f"{field_of(setting.old)} and {setting.field} are both set; {setting.field} is read",
                            f"Remove {field_of(setting.old)}, the name 0.1 gave it.",
                        )
                    )
                continue
            found.append(_renamed(where[1], setting))
        for namespace in self.by_path.values():
            if namespace.old is not None and self._at_quietly(namespace.old) not in (_MISSING, None):
                found.append(_renamed(namespace.old, namespace))
        return found

    def _at_quietly(self, path: KeyPath) -> Any:
        try:
            return self._at(path)
        except ConfigurationError:
            return _MISSING

    def _unknown_keys(self, path: KeyPath, value: Any, found: list[Finding]) -> None:
        if not isinstance(value, Mapping) or (path and self._is_legacy(path, value)):
            return
        namespace = self.by_path.get(path)
        if namespace is None and path not in self.old_containers:
            return  # a setting's own value (TIERS, OPTIONS...): its parser checks it
        current = namespace.keys() if namespace is not None else self.old_keys[path]
        known = current | self.old_keys.get(path, set())
        for key in value:
            if key not in known:
                close = _closest(str(key), current)
                found.append(
                    Finding(
                        "unknown",
                        f"{field_of((*path, str(key)))} is not a ratelimits setting",
                        f"Did you mean {close!r}?" if close else None,
                    )
                )
            else:
                self._unknown_keys((*path, key), value[key], found)


def _renamed(old: KeyPath, new: Setting[Any] | type[Namespace]) -> Finding:
    field = new.field if isinstance(new, Setting) else new.field()
    return Finding(
        "renamed",
        f"{field_of(old)} is the name 0.1 gave {field}; it is read as such until {OLD_NAMES_UNTIL}",
        f"Rename it {field}.",
    )


def _closest(key: str, known: set[str]) -> str | None:
    """The known key closest to ``key``, whatever their case (0.1's nested keys were lower case)."""
    by_upper = {name.upper(): name for name in known}
    close = difflib.get_close_matches(key.upper(), sorted(by_upper), n=1)
    return by_upper[close[0]] if close else None


def _every(namespace: type[Namespace]) -> Iterator[type[Namespace]]:
    yield namespace
    for inner in namespace.namespaces():
        yield from _every(inner)


def reference(root: type[Root]) -> str:
    """docs/configuration.md's tables of every setting under ``root``, in Markdown, from their declarations."""
    sections = []
    for namespace in _every(root):
        if namespace is root:
            title, intro = "The top level", "`RATELIMITS` itself: the settings most projects set, and the namespaces."
        else:
            title = namespace.path[-1] + "".join(f" (in {key})" for key in reversed(namespace.path[:-1]))
            intro = namespace.doc[0].upper() + namespace.doc[1:] + "."
        rows = ["| setting | default | meaning | 0.1 name | id |", "|---|---|---|---|---|"]
        for setting in namespace.declared():
            old = setting.old or (namespace.path if namespace.legacy == setting.attr else None)
            was = f"`{field_of(old).removeprefix('RATELIMITS')}`" if old else ""
            rows.append(f"| `{setting.key}` | {_shown(setting)} | {setting.doc} | {was} | `{setting.id}` |")
        for inner in namespace.namespaces():
            rows.append(f"| `{inner.path[-1]}` | | a namespace ([below](#{_anchor(inner)})) | | `{inner.id}` |")
        sections.append(f"### {title}\n\n{intro}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


def _shown(setting: Setting[Any]) -> str:
    if setting.shown is not None:
        return setting.shown
    default = setting.default
    if isinstance(default, str):
        return f'`"{default}"`'
    if isinstance(default, (dict, list)) and not default:
        return f"`{default!r}`"
    return f"`{default!r}`".replace("'", '"')


def _anchor(namespace: type[Namespace]) -> str:
    """The anchor of the namespace's heading (``### ADAPTIVE (in SHEDDING)``), as MkDocs and GitHub make it."""
    inner, *outer = reversed(namespace.path)
    return "-".join([inner.lower(), *(f"in-{key.lower()}" for key in outer)])
