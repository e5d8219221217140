"""Resolve a model reference given on the command line to a checkpoint URL.

- `models:/NAME@ALIAS` (e.g. `models:/rstar2-agent@champion`) and `models:/NAME/VERSION`: looked up in
  the MLflow model registry at the config's tracking URI; the version's tag `checkpoint_url` (the
  registry convention of docs/CONTRACTS.md) is the HF checkpoint folder.
- anything else is a checkpoint URL or path (file://, s3://, a local folder).

Either way the folder must exist and be a complete checkpoint (`_COMPLETE` marker, or an HF
`config.json` for folders not written by us); otherwise `ModelRefError` says what is missing,
before any model is loaded. Used by `rstar2 eval` and by the evaluate/nightly flows
(`tasks.registry.resolve_model`); mlflow is imported lazily so the CLI stays fast for plain URLs.
"""

from __future__ import annotations

from rstar2_core import storage


class ModelRefError(ValueError):
    """A model reference that does not resolve to a usable checkpoint; the message says why."""


def _sqlite_path(tracking_uri: str) -> str | None:
    return tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else None


def registry_checkpoint(ref: str, tracking_uri: str) -> tuple[str, str]:
    """(checkpoint URL, version) of a `models:/NAME@ALIAS` or `models:/NAME/VERSION` reference."""
    body = ref[len("models:/"):]
    if "@" in body:
        name, alias, version = *body.split("@", 1), None
    elif "/" in body:
        (name, version), alias = body.rsplit("/", 1), None
    else:
        raise ModelRefError(f"{ref!r}: use models:/NAME@ALIAS (e.g. models:/rstar2-agent@champion) or "
                            "models:/NAME/VERSION")
    if not name or not (alias or version):
        raise ModelRefError(f"{ref!r}: empty model name, alias or version")
    db = _sqlite_path(tracking_uri)
    if db is not None:
        from pathlib import Path

        if not Path(db).exists():
            raise ModelRefError(f"{ref!r}: no MLflow database at {db} (tracking.tracking_uri); run the recipe "
                                "flow first, point --set tracking.tracking_uri=... at the right store, or pass "
                                "a checkpoint URL")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        registered = client.get_registered_model(name)
    except MlflowException:
        raise ModelRefError(f"{ref!r}: no registered model {name!r} in {tracking_uri}") from None
    try:
        mv = (client.get_model_version_by_alias(name, alias) if alias
              else client.get_model_version(name, version))
    except MlflowException:
        what = f"alias {alias!r}" if alias else f"version {version}"
        known = sorted(getattr(registered, "aliases", {}) or {})
        raise ModelRefError(f"{ref!r}: registered model {name!r} has no {what} "
                            f"(aliases: {known})") from None
    url = (mv.tags or {}).get("checkpoint_url")
    if not url:
        raise ModelRefError(f"{ref!r}: version {mv.version} of {name!r} has no `checkpoint_url` tag; "
                            "register versions through the recipe flow (it sets the tag)")
    return url, str(mv.version)


def check_checkpoint(url: str) -> str:
    """Raise ModelRefError unless `url` is an existing, complete checkpoint folder."""
    if not storage.exists(url):
        raise ModelRefError(f"model {url!r} does not exist; pass a checkpoint folder URL or models:/NAME@ALIAS")
    if not (storage.is_complete(url) or storage.exists(storage.join(url, "config.json"))):
        raise ModelRefError(f"model {url!r} is not a complete checkpoint (no {storage.COMPLETE_MARKER} marker "
                            "and no config.json): it may still be being written, or it is not a checkpoint")
    return url


def resolve_model_ref(ref: str, tracking_uri: str) -> str:
    """Checkpoint URL for a `models:/...` reference or a checkpoint URL/path (checked to exist)."""
    url = registry_checkpoint(ref, tracking_uri)[0] if ref.startswith("models:/") else ref
    return check_checkpoint(url)
