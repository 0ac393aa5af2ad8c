"""A Kubernetes API emulator on loopback HTTP, for running the real operator in tests.

The operator runs for real (``distbelief operator`` or ``kopf run`` as a subprocess, or
kopf's KopfRunner) with a kubeconfig pointing at :class:`KubeEmulator`; kubectl and the
official Python client talk to it too. It serves exactly what those clients rely on:

* discovery (``/api``, ``/apis``, group versions with verbs, short names, the status
  and scale subresources), ``/version``, health endpoints;
* list/get/create/update/patch/delete/watch for the built-in kinds the operator touches
  and for every CRD stored in it (this project's, kopf's peering CRDs, any posted);
* server-assigned uid, a global resourceVersion, generation (bumped by spec changes
  only), creationTimestamp, generateName; 409 on name clashes and stale
  resourceVersions; merge, JSON (with ``test``) and naive strategic-merge patches;
* the status subresource (the main endpoint ignores .status, /status changes only it),
  the scale subresource through the CRD's own replica and selector paths;
* CRD defaulting and validation through a pluggable validator (the project's
  ``spec.validate_job``), answered as 422 Invalid naming each field;
* finalizers (deletionTimestamp until they are emptied), background, foreground and
  orphan garbage collection by ownerReferences, namespace deletion;
* watches from a resourceVersion (only later events; 410 Gone past a bounded history),
  label and field selectors on lists and watches, server-side Tables for ``kubectl get``
  (and ``get --watch``) built from the CRD's printer columns.

Why our own server and not kmock's KubernetesEmulator: kmock 0.8 was read and tried
first. Its emulator keeps state in its request interceptor (``_handle``) and its
request parser (``Request._parse`` -> ``parse_path``) runs before any override point,
so ``GET /api/v1/namespaces`` fails there (a ValueError, answered as 500) and
``/api/v1/namespaces/NAME`` is read as a namespace with no resource. Fixing that, and
adding resourceVersions, generation, PUT (kmock maps only PATCH to updates), patch
types, status/scale isolation, validation, garbage collection and resumable watches,
would mean overriding its ``__call__``, ``_handle`` and every ``_serve_*`` method while
relying on its private attributes (``_requests``, ``_errors``, ``_payloads``,
``StreamingError``) -- a fork in all but name, against a 0.x API. What would remain of
kmock is aiohttp, which this package uses directly. So: a small aiohttp server
(``server``) over an HTTP-free store with the semantics (``store``), pure helpers for
patches, selectors and views (``objects``), and the served types (``catalog``).

Not emulated: authentication and RBAC (any token is accepted), admission webhooks,
conversion between CRD versions (one served version per type is assumed), server-side
apply (``application/apply-patch+yaml`` answers 415) and managedFields,
``limit``/``continue`` paging (everything comes in one page), deletecollection, field
pruning (unknown fields are rejected by the validator instead), built-in defaulting and
validation (built-in kinds are stored as sent; every kind gets a generation, where real
ConfigMaps and Secrets have none), controllers and the kubelet (nothing creates Pods or
fills in Deployment status: tests do that with ``patch_status``), graceful Pod
termination, the events.k8s.io/v1 view of core Events (the two are stored apart),
OpenAPI documents (``/openapi/v2`` and ``/v3`` answer 404, so kubectl needs
``--validate=false``), protobuf request bodies (kubectl's typed generators such as
``kubectl create configmap`` send them and get 415; ``kubectl apply -f`` sends JSON),
aggregated discovery (kubectl falls back to the plain documents). A namespace comes into
being when first used, where a real server answers 404.
"""

from .catalog import ResourceType, ScalePaths
from .emulator import KubeEmulator
from .server import RequestRecord
from .store import ApiError

__all__ = ["ApiError", "KubeEmulator", "RequestRecord", "ResourceType", "ScalePaths"]
