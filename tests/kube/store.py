"""The emulated API server's state and semantics, independent of HTTP.

One :class:`Store` holds every object, a global resourceVersion counter, a bounded
history of change events and the open watches. Its methods are the API verbs (list,
get, create, replace, patch, delete, watch) with the server-side rules the operator and
kubectl rely on: server-assigned metadata, optimistic concurrency, generation,
status/scale subresources, CRD defaulting and validation, finalizers and garbage
collection. Errors are :class:`ApiError`, which the HTTP layer renders as metav1 Status.

Thread safety: every method takes one re-entrant lock, so the HTTP server (its own
thread) and test code (accessors, kubelet-like status writes) can share the store.
Stored dicts are never mutated in place, only replaced, so watch events can hold them.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import random
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import objects
from .catalog import CRD_TYPE_KEY, Catalog, ResourceType, types_of_crd

Validator = Callable[[dict[str, Any]], dict[str, Any]]
Key = tuple[str, str | None, str]  # (type key, namespace, name)

NAMESPACES_KEY = "v1/namespaces"
FOREGROUND = "foregroundDeletion"


class ApiError(Exception):
    """An API failure with its HTTP code, metav1 Status reason and message."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        doc = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            doc["details"] = self.details
        return doc

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)

    @classmethod
    def not_found(cls, rt: ResourceType | None = None, name: str = "") -> ApiError:
        if rt is None:
            return cls(404, "NotFound", "the server could not find the requested resource")
        return cls(404, "NotFound", f'{rt.group_resource} "{name}" not found',
                   {"name": name, "group": rt.group, "kind": rt.plural})

    @classmethod
    def already_exists(cls, rt: ResourceType, name: str) -> ApiError:
        return cls(409, "AlreadyExists", f'{rt.group_resource} "{name}" already exists',
                   {"name": name, "group": rt.group, "kind": rt.plural})

    @classmethod
    def conflict(cls, rt: ResourceType, name: str, why: str = "") -> ApiError:
        why = why or "the object has been modified; please apply your changes to the latest version and try again"
        return cls(409, "Conflict", f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {why}',
                   {"name": name, "group": rt.group, "kind": rt.plural})

    @classmethod
    def invalid(cls, rt: ResourceType, name: str, problems: list[str]) -> ApiError:
        """422 Invalid; each problem is a ``field: rule`` line, as the project's validator writes."""
        causes = []
        for line in problems:
            field, _, rule = line.partition(": ")
            causes.append({"reason": "FieldValueInvalid", "field": field, "message": rule or line})
        listed = problems[0] if len(problems) == 1 else f"[{', '.join(problems)}]"
        group_kind = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
        return cls(422, "Invalid", f'{group_kind} "{name}" is invalid: {listed}',
                   {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes})

    @classmethod
    def gone(cls, message: str) -> ApiError:
        return cls(410, "Expired", message)


@dataclasses.dataclass(frozen=True)
class Event:
    rv: int
    rt: ResourceType
    type: str                      # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]            # the object after the change (its last state if DELETED)
    old: dict[str, Any] | None     # the object before the change


class Watch:
    """One open watch: what to send first, then the live events the store queues for it."""

    def __init__(self, store: Store, rt: ResourceType, namespace: str | None, name: str | None,
                 label_selector: str | None, field_selector: str | None, loop: asyncio.AbstractEventLoop) -> None:
        self.store, self.rt, self.namespace, self.name = store, rt, namespace, name
        try:
            self._labels = objects.parse_label_selector(label_selector)
            self._fields = objects.parse_field_selector(field_selector)
        except ValueError as exc:
            raise ApiError.bad_request(str(exc)) from None
        self.loop = loop
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self.initial: list[dict[str, Any]] = []   # ADDED events of the objects that exist now
        self.backlog: list[Event] = []            # history after the requested resourceVersion
        self.bookmark: str | None = None          # rv of the initial-events-end bookmark, if asked

    def matches(self, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return ((self.namespace is None or meta.get("namespace") == self.namespace)
                and (self.name is None or meta.get("name") == self.name)
                and all(req(meta.get("labels") or {}) for req in self._labels)
                and all(check(obj) for check in self._fields))

    def translate(self, event: Event) -> dict[str, Any] | None:
        """The event as this watch sees it: objects entering or leaving its selectors are
        reported as ADDED or DELETED, the way the API server does."""
        now, before = self.matches(event.obj), event.old is not None and self.matches(event.old)
        if event.type == "MODIFIED":
            kind = "MODIFIED" if now and before else "ADDED" if now else "DELETED" if before else None
        else:
            kind = event.type if now else None
        return None if kind is None else {"type": kind, "object": event.obj}

    def push(self, event: Event | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the server's loop is already closed
            pass

    def close(self) -> None:
        self.store.unwatch(self)


class Store:
    def __init__(self, catalog: Catalog, validators: Mapping[str, Validator] | None = None,
                 history: int = 10_000) -> None:
        self.catalog = catalog
        self.validators = dict(validators or {})
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)  # notified after every write
        self._objects: dict[Key, tuple[ResourceType, dict[str, Any]]] = {}
        self._rv = 0
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._floor = 0  # events with rv <= floor may have left the history
        self._watches: set[Watch] = set()
        self.closed = False

    # ------------------------------------------------------------------- reading

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def list(self, rt: ResourceType, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]:
        """The matching objects sorted by namespace and name, and the list's resourceVersion."""
        try:
            labels = objects.parse_label_selector(label_selector)
            fields = objects.parse_field_selector(field_selector)
        except ValueError as exc:
            raise ApiError.bad_request(str(exc)) from None
        with self._lock:
            found = [obj for (key, ns, _), (_, obj) in sorted(self._objects.items(), key=_sort_key)
                     if key == rt.key and (namespace is None or ns == namespace)
                     and all(req(obj["metadata"].get("labels") or {}) for req in labels)
                     and all(check(obj) for check in fields)]
            return copy.deepcopy(found), str(self._rv)

    def get(self, rt: ResourceType, namespace: str | None, name: str, subresource: str | None = None
            ) -> dict[str, Any]:
        with self._lock:
            obj = self._current(rt, namespace, name)
            return objects.scale_of(rt, obj) if subresource == "scale" else copy.deepcopy(obj)

    def find(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._objects.get((rt.key, namespace if rt.namespaced else None, name))
            return copy.deepcopy(entry[1]) if entry else None

    def _current(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        entry = self._objects.get((rt.key, namespace if rt.namespaced else None, name))
        if entry is None:
            raise ApiError.not_found(rt, name)
        return entry[1]

    # ------------------------------------------------------------------- writing

    def create(self, rt: ResourceType, namespace: str | None, body: Any, *, dry_run: bool = False
               ) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise ApiError.bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(dict(body))
        for field, wanted in (("apiVersion", rt.api_version), ("kind", rt.kind)):
            if obj.setdefault(field, wanted) != wanted:
                raise ApiError.bad_request(f"{field} {obj[field]!r} does not match the resource "
                                           f"{rt.group_resource}, which wants {wanted!r}")
        meta = obj["metadata"] = dict(obj.get("metadata") or {})
        with self._lock:
            if rt.namespaced:
                namespace = namespace or meta.get("namespace") or "default"
                if meta.get("namespace") not in (None, "", namespace):
                    raise ApiError.bad_request("the namespace of the provided object does not match "
                                               "the namespace sent on the request")
                meta["namespace"] = namespace
                self._check_namespace_open(namespace)
            else:
                namespace = None
                meta.pop("namespace", None)
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise ApiError.invalid(rt, "", ["metadata.name: Required value: name or generateName "
                                                    "is required"])
                meta["name"] = meta["generateName"] + "".join(random.choices(_NAME_CHARS, k=5))
            name = meta["name"]
            if (rt.key, namespace, name) in self._objects:
                raise ApiError.already_exists(rt, name)
            if rt.status:
                obj.pop("status", None)  # as PrepareForCreate does; /status writes it later
            for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink", "managedFields"):
                meta.pop(field, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=objects.timestamp(), generation=1,
                        resourceVersion="")
            if rt.key == NAMESPACES_KEY:
                meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = name
                obj["status"] = {"phase": "Active"}
            obj = self._validate(rt, obj)
            if rt.key == CRD_TYPE_KEY:
                obj["status"] = _crd_status(obj)
            if dry_run:
                return obj
            if namespace is not None:
                self._ensure_namespace(namespace)
            self._commit(rt, "ADDED", obj, None)
            return copy.deepcopy(obj)

    def replace(self, rt: ResourceType, namespace: str | None, name: str, body: Any, *,
                subresource: str | None = None, dry_run: bool = False) -> dict[str, Any]:
        """PUT: the whole object (or its status, or its Scale) as given."""
        with self._lock:
            old = self._current(rt, namespace, name)
            if subresource == "scale":
                return self._write_scale(rt, old, body, dry_run)
            result = self._write(rt, old, body, subresource, dry_run)
            self._settle()
            return copy.deepcopy(result)

    def patch(self, rt: ResourceType, namespace: str | None, name: str, patch: Any, content_type: str, *,
              subresource: str | None = None, dry_run: bool = False) -> dict[str, Any]:
        apply = objects.PATCHES.get(content_type)
        if apply is None:
            raise ApiError(415, "UnsupportedMediaType", f"the patch type {content_type!r} is not supported; "
                           f"use one of {', '.join(objects.PATCHES)}")
        with self._lock:
            old = self._current(rt, namespace, name)
            current = objects.scale_of(rt, old) if subresource == "scale" else copy.deepcopy(old)
            try:
                patched = apply(current, patch)
            except objects.MalformedPatch as exc:
                raise ApiError.bad_request(str(exc)) from None
            except objects.PatchError as exc:
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our "
                               f"request: {exc}", {"name": name, "group": rt.group, "kind": rt.plural}) from None
            if subresource == "scale":
                return self._write_scale(rt, old, patched, dry_run)
            result = self._write(rt, old, patched, subresource, dry_run)
            self._settle()
            return copy.deepcopy(result)

    def delete(self, rt: ResourceType, namespace: str | None, name: str, *, propagation: str | None = None,
               preconditions: Mapping[str, Any] | None = None, dry_run: bool = False
               ) -> tuple[dict[str, Any], bool]:
        """The object and whether it is gone; finalizers keep it, with a deletionTimestamp."""
        if propagation not in (None, "Background", "Foreground", "Orphan"):
            raise ApiError.bad_request(f"unsupported propagationPolicy {propagation!r}")
        with self._lock:
            obj = self._current(rt, namespace, name)
            meta = obj["metadata"]
            for field in ("uid", "resourceVersion"):
                wanted = (preconditions or {}).get(field)
                if wanted and wanted != meta.get(field):
                    raise ApiError.conflict(rt, name, f"Precondition failed: {field} in precondition: "
                                                      f"{wanted}, {field} in object meta: {meta.get(field)}")
            if dry_run:
                return copy.deepcopy(obj), not meta.get("finalizers")
            result, _ = self._delete(rt, obj, propagation or "Background")
            self._settle()
            current = self._objects.get(_key(rt, result))
            return copy.deepcopy(current[1] if current else result), current is None

    # ---------------------------------------------------------------- watching

    def watch(self, rt: ResourceType, namespace: str | None, *, name: str | None = None, since: str | None = None,
              label_selector: str | None = None, field_selector: str | None = None,
              initial_events: bool = False, loop: asyncio.AbstractEventLoop) -> Watch:
        """A watch from ``since`` (its later events only), or from now with an ADDED event per
        existing object when ``since`` is empty or "0" (or ``initial_events`` is asked)."""
        watch = Watch(self, rt, namespace, name, label_selector, field_selector, loop)
        with self._lock:
            if self.closed:
                raise ApiError(503, "ServiceUnavailable", "the server is shutting down")
            if since in (None, "", "0") or initial_events:
                watch.initial = [{"type": "ADDED", "object": obj}
                                 for (key, _, _), (_, obj) in sorted(self._objects.items(), key=_sort_key)
                                 if key == rt.key and watch.matches(obj)]
                if initial_events:
                    watch.bookmark = str(self._rv)
            else:
                try:
                    start = int(since)
                except ValueError:
                    raise ApiError.bad_request(f"invalid resourceVersion {since!r}") from None
                if start < self._floor:
                    raise ApiError.gone(f"too old resource version: {start} ({self._floor + 1})")
                watch.backlog = [e for e in self._history if e.rv > start and e.rt.key == rt.key]
            self._watches.add(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def close(self) -> None:
        """End every open watch (their streams finish) and refuse new ones."""
        with self._lock:
            self.closed = True
            for watch in self._watches:
                watch.push(None)

    # ------------------------------------------------------------------ internals

    def _commit(self, rt: ResourceType, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """Give ``obj`` the next resourceVersion, store (or drop) it, record and publish the event."""
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = _key(rt, obj)
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = (rt, obj)
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            self._floor = self._history[0].rv
        event = Event(self._rv, rt, kind, obj, old)
        self._history.append(event)
        for watch in self._watches:
            if watch.rt.key == rt.key:
                watch.push(event)
        if rt.key == CRD_TYPE_KEY:
            self._crd_changed(kind, obj, old)
        self.changed.notify_all()

    def _write(self, rt: ResourceType, old: dict[str, Any], new: Any, subresource: str | None,
               dry_run: bool) -> dict[str, Any]:
        """An update of ``old`` to ``new`` with the server's rules; returns the stored result."""
        if not isinstance(new, Mapping):
            raise ApiError.bad_request("the request body must be a JSON object")
        old_meta, name = old["metadata"], old["metadata"]["name"]
        meta = new.get("metadata") if isinstance(new.get("metadata"), Mapping) else {}
        if meta.get("resourceVersion") and meta["resourceVersion"] != old_meta["resourceVersion"]:
            raise ApiError.conflict(rt, name)
        if meta.get("name", name) != name:
            raise ApiError.bad_request(f"the name of the object ({meta['name']}) does not match the name "
                                       f"on the URL ({name})")
        if subresource == "status":
            result = copy.deepcopy(old)  # /status changes .status and nothing else
            if "status" in new:
                result["status"] = copy.deepcopy(new["status"])
            else:
                result.pop("status", None)
        else:
            result = copy.deepcopy(dict(new))
            result.update(apiVersion=rt.api_version, kind=rt.kind)
            result["metadata"] = meta = dict(meta)
            for field in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                          "deletionGracePeriodSeconds", "generation"):
                if field in old_meta:
                    meta[field] = old_meta[field]
                else:
                    meta.pop(field, None)
            if rt.status:  # the main endpoint ignores .status
                if "status" in old:
                    result["status"] = copy.deepcopy(old["status"])
                else:
                    result.pop("status", None)
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if old_meta.get("deletionTimestamp") and added:
                raise ApiError.invalid(rt, name, ["metadata.finalizers: Forbidden: no new finalizers can be "
                                                  "added if the object is being deleted"])
        result["metadata"]["resourceVersion"] = old_meta["resourceVersion"]
        result = self._validate(rt, result)
        if _spec_part(result) != _spec_part(old):
            result["metadata"]["generation"] = old_meta.get("generation", 1) + 1
        if result == old or dry_run:  # a no-op write keeps the resourceVersion and sends no event
            return result
        self._commit(rt, "MODIFIED", result, old)
        return result

    def _write_scale(self, rt: ResourceType, old: dict[str, Any], scale: Any, dry_run: bool) -> dict[str, Any]:
        replicas = objects.lookup(scale, ("spec", "replicas"))
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ApiError.invalid(rt, old["metadata"]["name"],
                                   [f"spec.replicas: Invalid value: {replicas!r}: must be a non-negative integer"])
        wanted = objects.lookup(scale, ("metadata", "resourceVersion"))
        new = copy.deepcopy(old)
        new["metadata"]["resourceVersion"] = wanted or old["metadata"]["resourceVersion"]
        objects.assign(new, rt.scale.spec_replicas, replicas)  # type: ignore[union-attr]
        result = self._write(rt, old, new, None, dry_run)
        self._settle()
        return objects.scale_of(rt, result)

    def _validate(self, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"].get("name", "")
        if rt.key == CRD_TYPE_KEY:
            try:
                types = types_of_crd(obj)
            except (KeyError, TypeError, ValueError) as exc:
                raise ApiError.invalid(rt, name, [f"spec: Invalid value: {exc}"]) from None
            wanted = {f"{t.plural}.{t.group}" for t in types}
            if wanted and wanted != {name}:
                raise ApiError.invalid(rt, name, [f"metadata.name: Invalid value: {name!r}: must be "
                                                  f"spec.names.plural+\".\"+spec.group"])
        validator = self.validators.get(rt.key)
        if validator is None:
            return obj
        try:
            return validator(obj)
        except ValueError as exc:  # the project's SpecError, with one line per problem
            raise ApiError.invalid(rt, name, list(getattr(exc, "errors", None) or [str(exc)])) from None

    def _delete(self, rt: ResourceType, obj: dict[str, Any], propagation: str) -> tuple[dict[str, Any], bool]:
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return obj, False  # already being deleted
        if propagation == "Orphan":
            self._orphan(meta["uid"])
        finalizers = list(meta.get("finalizers") or [])
        if propagation == "Foreground" and FOREGROUND not in finalizers and any(self._dependents(meta["uid"])):
            finalizers.append(FOREGROUND)
        is_namespace = rt.key == NAMESPACES_KEY
        if not finalizers and not (is_namespace and any(self._contents(meta["name"]))):
            gone = copy.deepcopy(obj)
            self._commit(rt, "DELETED", gone, obj)
            self._collect(gone)
            return gone, True
        marked = copy.deepcopy(obj)
        marked["metadata"].update(deletionTimestamp=objects.timestamp(), deletionGracePeriodSeconds=0,
                                  generation=meta.get("generation", 1) + 1)
        if finalizers:
            marked["metadata"]["finalizers"] = finalizers
        if is_namespace:
            marked["status"] = {"phase": "Terminating"}
        self._commit(rt, "MODIFIED", marked, obj)
        if propagation == "Foreground":
            for dep_rt, dep in list(self._dependents(meta["uid"])):
                self._delete(dep_rt, dep, "Background")
        if is_namespace:
            for dep_rt, dep in list(self._contents(meta["name"])):
                self._delete(dep_rt, dep, "Background")
        return marked, False

    def _collect(self, gone: dict[str, Any]) -> None:
        """Garbage collection after ``gone`` left: its dependents whose every owner is gone."""
        uid = gone["metadata"]["uid"]
        live = {obj["metadata"]["uid"] for _, obj in self._objects.values()}
        for rt, obj in list(self._dependents(uid)):
            owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
            if not owners & live and _key(rt, obj) in self._objects:
                self._delete(rt, self._objects[_key(rt, obj)][1], "Background")

    def _settle(self) -> None:
        """Finish pending deletions that nothing holds any more (finalizers gone, no dependents
        left for foreground deletion, no contents left in a terminating namespace)."""
        progress = True
        while progress:
            progress = False
            for rt, obj in list(self._objects.values()):
                meta = obj["metadata"]
                if not meta.get("deletionTimestamp") or self._objects.get(_key(rt, obj), (None, None))[1] is not obj:
                    continue
                finalizers = list(meta.get("finalizers") or [])
                if FOREGROUND in finalizers and not any(self._dependents(meta["uid"])):
                    finalizers.remove(FOREGROUND)
                    released = copy.deepcopy(obj)
                    released["metadata"]["finalizers"] = finalizers
                    if not finalizers:
                        del released["metadata"]["finalizers"]
                    self._commit(rt, "MODIFIED", released, obj)
                    obj, progress = released, True
                busy = rt.key == NAMESPACES_KEY and any(self._contents(meta["name"]))
                if not finalizers and not busy:
                    gone = copy.deepcopy(obj)
                    self._commit(rt, "DELETED", gone, obj)
                    self._collect(gone)
                    progress = True

    def _dependents(self, uid: str) -> Iterator[tuple[ResourceType, dict[str, Any]]]:
        for rt, obj in list(self._objects.values()):
            if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                yield rt, obj

    def _contents(self, namespace: str) -> Iterator[tuple[ResourceType, dict[str, Any]]]:
        for (_, ns, _), (rt, obj) in list(self._objects.items()):
            if ns == namespace:
                yield rt, obj

    def _orphan(self, uid: str) -> None:
        for rt, obj in list(self._dependents(uid)):
            freed = copy.deepcopy(obj)
            refs = [r for r in obj["metadata"]["ownerReferences"] if r.get("uid") != uid]
            if refs:
                freed["metadata"]["ownerReferences"] = refs
            else:
                del freed["metadata"]["ownerReferences"]
            self._commit(rt, "MODIFIED", freed, obj)

    def _check_namespace_open(self, namespace: str) -> None:
        entry = self._objects.get((NAMESPACES_KEY, None, namespace))
        if entry and entry[1]["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden", f"unable to create new content in namespace {namespace} "
                                             "because it is being terminated")

    def _ensure_namespace(self, namespace: str) -> None:
        """Namespaces come into being when first used (a real server would answer 404)."""
        if (NAMESPACES_KEY, None, namespace) not in self._objects:
            self.create(self.catalog.resolve(NAMESPACES_KEY), None, {"metadata": {"name": namespace}})

    def _crd_changed(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """Serve what a CRD defines from the moment it is stored; drop its objects when it goes."""
        if old is not None:
            self.catalog.remove(types_of_crd(old))
        if kind == "DELETED":
            dropped = {t.key for t in types_of_crd(obj)}
            for key, (rt, item) in list(self._objects.items()):
                if key[0] in dropped:
                    self._commit(rt, "DELETED", copy.deepcopy(item), item)
        else:
            self.catalog.add(types_of_crd(obj))


_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the API server uses for generateName


def _key(rt: ResourceType, obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return (rt.key, meta.get("namespace") if rt.namespaced else None, meta["name"])


def _sort_key(item: tuple[Key, Any]) -> tuple[str, str, str]:
    (key, namespace, name), _ = item
    return key, namespace or "", name


def _spec_part(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What metadata.generation counts changes of: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _crd_status(crd: Mapping[str, Any]) -> dict[str, Any]:
    now = objects.timestamp()
    spec = crd.get("spec") or {}
    condition = {"status": "True", "lastTransitionTime": now}
    return {
        "conditions": [{**condition, "type": "NamesAccepted", "reason": "NoConflicts",
                        "message": "no conflicts found"},
                       {**condition, "type": "Established", "reason": "InitialNamesAccepted",
                        "message": "the initial names have been accepted"}],
        "acceptedNames": copy.deepcopy(spec.get("names") or {}),
        "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
    }


__all__ = ["ApiError", "Event", "Store", "Validator", "Watch"]
