"""OpenAI's files and fine-tuning jobs endpoints (the official `openai` client works unchanged):

    POST /v1/files (multipart: file, purpose=fine-tune)   GET /v1/files[/{id}[/content]]   DELETE /v1/files/{id}
    POST /v1/fine_tuning/jobs                              GET /v1/fine_tuning/jobs[/{id}]  (?after=&limit=)
    POST /v1/fine_tuning/jobs/{id}/cancel | /pause | /resume
    GET  /v1/fine_tuning/jobs/{id}/events | /checkpoints   (?after=&limit=)

A job's body is OpenAI's (model, training_file, validation_file, suffix, seed, method: supervised with n_epochs,
batch_size, learning_rate_multiplier, each "auto" or a value), plus symbiosis's `peft`: {"method": "lora" | "rslora" |
"dora" | "ia3" | "loha" | "lokr" | "prefix_tuning" | "prompt_tuning" | ..., "config": {PEFT's fields}} (default
LoRA r 16, alpha 32, every linear layer). Errors in OpenAI's envelope (errors.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from symbiosis.serve.errors import ApiError, json_object
from symbiosis.train.data import MAX_FILE_BYTES


def router(service, tenant_dependency) -> APIRouter:
    api = APIRouter(prefix="/v1")
    caller = Depends(tenant_dependency)
    jobs = service.jobs

    def limit_of(limit: int) -> int:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be 1..100", "limit")
        return limit

    @api.post("/files")
    async def upload(file: UploadFile = File(...), purpose: str = Form(...), tenant: str = caller):
        data = await file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ApiError(413, f"a file is at most {MAX_FILE_BYTES} bytes", "file")
        # (checking a file's lines is seconds of CPU for a large one: not on the event loop, which every request needs)
        return await run_in_threadpool(jobs.upload, tenant, file.filename or "", purpose, data)

    @api.get("/files")
    def list_files(purpose: str | None = None, tenant: str = caller):
        return {"object": "list", "data": [jobs.file_object(r) for r in jobs.store.files(tenant, purpose)],
                "has_more": False}

    @api.get("/files/{file_id}")
    def get_file(file_id: str, tenant: str = caller):
        return jobs.file_object(jobs.file(tenant, file_id))

    @api.get("/files/{file_id}/content")
    def file_content(file_id: str, tenant: str = caller):
        return Response(jobs.file_content(tenant, file_id), media_type="application/jsonl")

    @api.delete("/files/{file_id}")
    def delete_file(file_id: str, tenant: str = caller):
        jobs.delete_file(tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @api.post("/fine_tuning/jobs")
    async def create_job(request: Request, tenant: str = caller):
        return jobs.create(tenant, await json_object(request))

    @api.get("/fine_tuning/jobs")
    def list_jobs(after: str | None = None, limit: int = 20, tenant: str = caller):
        return jobs.jobs(tenant, after, limit_of(limit))

    @api.get("/fine_tuning/jobs/{job_id}")
    def get_job(job_id: str, tenant: str = caller):
        return jobs.job(tenant, job_id)

    for action in ("cancel", "pause", "resume"):
        def control(job_id: str, tenant: str = caller, action=action):
            return jobs.control(tenant, job_id, action)
        api.post(f"/fine_tuning/jobs/{{job_id}}/{action}", name=f"{action}_job")(control)

    @api.get("/fine_tuning/jobs/{job_id}/events")
    def job_events(job_id: str, after: str | None = None, limit: int = 20, tenant: str = caller):
        return jobs.events(tenant, job_id, after, limit_of(limit))

    @api.get("/fine_tuning/jobs/{job_id}/checkpoints")
    def job_checkpoints(job_id: str, after: str | None = None, limit: int = 10, tenant: str = caller):
        return jobs.checkpoints(tenant, job_id, after, limit_of(limit))

    return api
