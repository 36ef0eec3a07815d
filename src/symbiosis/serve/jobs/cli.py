"""`symbiosis jobs list | show JOB | follow JOB`: a fine-tuning job's progress from the command line, through the
service's HTTP API (standard library only: nothing heavy is imported).

    symbiosis jobs list --base-url http://127.0.0.1:8000/v1            # the key: --api-key or $SYMBIOSIS_API_KEY
    symbiosis jobs follow ftjob-...                                      # events as they come, a bar of the steps
"""

from __future__ import annotations

import json
import time

from symbiosis.serve.http_cli import add_connection, call

FINAL = ("succeeded", "failed", "cancelled")
BAR = 30


def _get(args, path: str) -> dict:
    return call(args, path, command="symbiosis jobs")


def _line(job: dict) -> str:
    progress = f"{job.get('last_step') or 0}/{job.get('total_steps') or '?'}"
    return (f"{job['id']}  {job['status']:<16} steps {progress:<9} {job.get('fine_tuned_model') or ''}").rstrip()


def list_jobs(args) -> int:
    for job in _get(args, f"/fine_tuning/jobs?limit={args.limit}")["data"]:
        print(_line(job))
    return 0


def show_job(args) -> int:
    job = _get(args, f"/fine_tuning/jobs/{args.job}")
    print(json.dumps(job, indent=2))
    checkpoints = _get(args, f"/fine_tuning/jobs/{args.job}/checkpoints?limit=100")["data"]
    for checkpoint in checkpoints:
        print(f"checkpoint step {checkpoint['step_number']}: {checkpoint['fine_tuned_model_checkpoint']}  "
              f"{json.dumps(checkpoint['metrics'])}")
    return 0


def _bar(step: int, total: int | None) -> str:
    if not total:
        return f"step {step}"
    done = min(BAR, round(BAR * step / total))
    return f"[{'#' * done}{'.' * (BAR - done)}] {step}/{total}"


def follow_job(args) -> int:
    """Print the job's events as they come (oldest first), metrics as a progress bar, until the job ends."""
    seen: set[str] = set()
    while True:
        job = _get(args, f"/fine_tuning/jobs/{args.job}")
        events = _get(args, f"/fine_tuning/jobs/{args.job}/events?limit=100")["data"]
        for event in reversed(events):
            if event["id"] in seen:
                continue
            seen.add(event["id"])
            data = event.get("data") or {}
            if event["type"] == "metrics" and "total_steps" in data:
                print(f"{_bar(data['step'], data['total_steps'])}  loss {data['train_loss']:.4f}", flush=True)
            else:
                print(f"{event['level']:<5} {event['message']}", flush=True)
        if job["status"] in FINAL:
            print(_line(job))
            return 0 if job["status"] == "succeeded" else 1
        time.sleep(args.interval)


def add_parser(commands) -> None:
    jobs = commands.add_parser("jobs", help="fine-tuning jobs of a running `symbiosis serve`: list, show, follow")
    add_connection(jobs)
    actions = jobs.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="your jobs, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(run=list_jobs)
    show = actions.add_parser("show", help="a job, and its checkpoints")
    show.add_argument("job")
    show.set_defaults(run=show_job)
    follow = actions.add_parser("follow", help="a job's events as they come, until it ends (exit 1 unless it "
                                               "succeeded)")
    follow.add_argument("job")
    follow.add_argument("--interval", type=float, default=1.0)
    follow.set_defaults(run=follow_job)
