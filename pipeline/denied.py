"""A store that refuses a request (S3's 403 AccessDenied, a bucket policy, a read-only local folder): one line naming
the object, the operation and the credential in use, never a secret.

s3fs turns S3's 403 into PermissionError("Forbidden") with the botocore ClientError (its operation name: PutObject,
GetObject, DeleteObject, ...) as the cause; that line names neither the object nor who asked. `access_denied` builds
AccessDenied from it: the user's permission, not a bug, so the CLI maps it to exit 2 (jobs.errors.storage_error).
"""

from __future__ import annotations

import getpass
import os

from fsspec import AbstractFileSystem


class AccessDenied(PermissionError):
    """The store refused `operation` on the object `url` to `credential`. str(): one line with the fix. Picklable
    (it crosses from Dask workers to the client with its message)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])


def _operation(e: BaseException, default: str) -> str:
    """The store's name of the refused operation (botocore's operation_name, e.g. s3:PutObject), from `e` or its
    causes; `default` when none says."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if name := getattr(cur, "operation_name", None):
            return f"s3:{name}"
        cur = cur.__cause__ or cur.__context__
    return default


def credential_in_use(fs: AbstractFileSystem) -> str:
    """Who the store sees for `fs`: for S3, the access key id and where botocore found it (environment, a profile,
    an assumed role, instance metadata), never the secret; for a local folder, the user. Best effort: a credential
    that cannot be resolved is said so."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not any(p.startswith(("s3", "r2")) for p in protocols):
        try:
            return f"user {getpass.getuser()}"
        except Exception:  # only for the message
            return f"uid {os.getuid()}"
    profile = (getattr(fs, "storage_options", None) or {}).get("profile") or os.environ.get("AWS_PROFILE")
    key = getattr(fs, "key", None)
    if key:
        return f"access key id {key} (given to fsspec)"
    try:
        import botocore.session

        session = botocore.session.Session(profile=profile)
        creds = session.get_credentials()
    except Exception as e:  # a broken profile: the message still names it
        return f"profile {profile!r} ({type(e).__name__})" if profile else "the default AWS credentials"
    if creds is None:
        return "no AWS credentials (anonymous)"
    where = {"env": "environment variables AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
             "shared-credentials-file": "~/.aws/credentials", "config-file": "~/.aws/config",
             "assume-role": "an assumed role", "iam-role": "the instance's IAM role",
             "container-role": "the container's task role",
             "assume-role-with-web-identity": "a web identity role (IRSA)"}.get(creds.method, creds.method)
    return (f"access key id {creds.access_key} (from {where}"
            + (f", profile {profile}" if profile else "") + ")")


def access_denied(e: PermissionError, fs: AbstractFileSystem, path: str, operation: str) -> AccessDenied:
    """The AccessDenied line for `e`, a refused request on `path` of `fs` (`operation`: the default name of the
    request, e.g. s3:PutObject, used when the error does not carry the store's own)."""
    if isinstance(e, AccessDenied):
        return e
    url = fs.unstrip_protocol(path) if not path.startswith(("/", ".")) or "://" in path else path
    return AccessDenied(f"access denied: {_operation(e, operation)} on {url} was refused to "
                        f"{credential_in_use(fs)} ({e}); grant it (a bucket policy or IAM policy that denies it, "
                        "or folder permissions) or give an OUTPUT this credential may write")
