"""What a preparation run produced and skipped, and the summary printed at its end."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from data_prep.spec import CLASS_NAMES


@dataclass
class Skipped:
    """One input that was not used: the file or building at fault and why."""

    item: str
    reason: str

    def __str__(self) -> str:
        return f"{self.item}: {self.reason}"


@dataclass
class PrepareReport:
    """Counts of chips written and of inputs skipped during one run."""

    chips: int = 0
    per_class: Counter = field(default_factory=Counter)
    per_event: Counter = field(default_factory=Counter)
    unlabelled: int = 0
    excluded_unclassified: int = 0
    not_covered: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    #: A scene's post-to-pre shift (:meth:`data_prep.alignment.SceneShift.to_dict`) and its line.
    alignment: dict | None = None
    alignment_text: str = ""
    #: Tiles read back from an earlier run (``prepare xbd --resume``); not part of :meth:`to_dict`.
    reused: int = 0

    def add_chip(self, event: str, label: int) -> None:
        self.chips += 1
        self.per_event[event] += 1
        if label >= 0:
            self.per_class[CLASS_NAMES[label]] += 1
        else:
            self.unlabelled += 1

    def skip(self, item: str, reason: str) -> None:
        self.skipped.append(Skipped(str(item), reason))

    def merge(self, other: PrepareReport) -> None:
        self.chips += other.chips
        self.per_class.update(other.per_class)
        self.per_event.update(other.per_event)
        self.unlabelled += other.unlabelled
        self.excluded_unclassified += other.excluded_unclassified
        self.not_covered += other.not_covered
        self.skipped.extend(other.skipped)

    def to_dict(self) -> dict:
        out = {
            "chips": self.chips,
            "per_class": {name: self.per_class.get(name, 0) for name in CLASS_NAMES},
            "per_event": dict(sorted(self.per_event.items())),
            "unlabelled": self.unlabelled,
            "excluded_unclassified": self.excluded_unclassified,
            "not_covered": self.not_covered,
            "skipped": [{"item": s.item, "reason": s.reason} for s in self.skipped],
        }
        if self.alignment is not None:
            out["alignment"] = self.alignment
        return out

    @classmethod
    def from_dict(cls, data: dict) -> PrepareReport:
        """The report :meth:`to_dict` gave."""
        report = cls(
            chips=int(data["chips"]),
            per_class=Counter({k: v for k, v in data.get("per_class", {}).items() if v}),
            per_event=Counter(data.get("per_event", {})),
            unlabelled=int(data.get("unlabelled", 0)),
            excluded_unclassified=int(data.get("excluded_unclassified", 0)),
            not_covered=int(data.get("not_covered", 0)),
            skipped=[Skipped(s["item"], s["reason"]) for s in data.get("skipped", [])],
        )
        report.alignment = data.get("alignment")
        return report

    def summary(self) -> str:
        lines = [f"chips written: {self.chips}"]
        if self.reused:
            lines.append(f"tiles taken from the earlier run (--resume): {self.reused}")
        lines.append(
            "per class: "
            + ", ".join(f"{n} {self.per_class.get(n, 0)}" for n in CLASS_NAMES)
            + (f", unlabelled {self.unlabelled}" if self.unlabelled else "")
        )
        if self.per_event:
            lines.append(
                "per event: " + ", ".join(f"{e} {n}" for e, n in sorted(self.per_event.items()))
            )
        if self.excluded_unclassified:
            lines.append(
                f"un-classified buildings excluded: {self.excluded_unclassified} (use --include-unclassified to keep them unlabelled)"
            )
        if self.alignment_text:
            lines.append(self.alignment_text)
        if self.not_covered:
            lines.append(f"buildings not covered by both pre and post imagery: {self.not_covered}")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} item(s):")
            lines.extend(f"  - {s}" for s in self.skipped)
        return "\n".join(lines)

    def exit_code(self, strict: bool = False) -> int:
        """0 on success; 1 when nothing was produced, or with ``strict`` when anything was skipped."""
        if self.chips == 0:
            return 1
        if strict and self.skipped:
            return 1
        return 0
