"""Files: upload (multipart, purpose=batch, optional expires_after), list, retrieve, content,
delete."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse

from minimill.api.deps import ConfigDep, StoreDep, TenantDep
from minimill.api.errors import error_responses
from minimill.api.schemas import FileDeleted, FileList, FileObject
from minimill.control import files
from minimill.control.tenant_limits import limits_for

router = APIRouter(prefix="/v1/files", tags=["files"], responses=error_responses(400, 401))
READ_BYTES = 1024 * 1024


def _parts(upload: UploadFile) -> Iterator[bytes]:
    while chunk := upload.file.read(READ_BYTES):
        yield chunk


@router.post("", response_model=FileObject, responses=error_responses(413))
def upload_file(
    file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()], store: StoreDep,
    tenant: TenantDep, config: ConfigDep,
    # OpenAI's `expires_after` object, as its clients send it in a multipart form.
    expires_anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    expires_seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None,
) -> FileObject:
    seconds = files.check_expires_after(expires_anchor, expires_seconds)
    record = files.create_file(store, tenant.id, purpose, file.filename or "upload.jsonl",
                               _parts(file), max_bytes=config.max_file_bytes,
                               expires_after_s=seconds or config.file_expires_after_s,
                               limits=limits_for(store, tenant.id, config.tenant_limits))
    return FileObject.of(record)


@router.get("", response_model=FileList, responses=error_responses(404))
def list_files(store: StoreDep, tenant: TenantDep, purpose: str | None = None,
               after: str | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
               order: Literal["asc", "desc"] = "desc") -> FileList:
    page, has_more = files.list_files(store, tenant.id, purpose=purpose, after=after,
                                      limit=limit, order=order)
    data = [FileObject.of(r) for r in page]
    return FileList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None)


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404))
def retrieve_file(file_id: str, store: StoreDep, tenant: TenantDep) -> FileObject:
    return FileObject.of(files.get_file(store, tenant.id, file_id))


@router.get("/{file_id}/content", responses={
    **error_responses(404),
    200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                               "format": "binary"}}}}})
def file_content(file_id: str, store: StoreDep, tenant: TenantDep) -> StreamingResponse:
    record, chunks = files.iter_content(store, tenant.id, file_id)
    # Uploaded names may hold quotes or control characters: only safe ones reach a header.
    safe_name = re.sub(r"[^A-Za-z0-9._-]", "_", record.filename)[:200]
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={
        "Content-Length": str(record.bytes),
        "Content-Disposition": f'attachment; filename="{safe_name}"'})


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404))
def delete_file(file_id: str, store: StoreDep, tenant: TenantDep) -> FileDeleted:
    files.delete_file(store, tenant.id, file_id)
    return FileDeleted(id=file_id, deleted=True)
