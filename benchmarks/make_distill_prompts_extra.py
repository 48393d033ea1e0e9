"""Writes benchmarks/distill_prompts_extra.v1.jsonl: a second distillation prompt set (new subjects,
tasks and phrasings; none shared with distill_prompts.v1.jsonl or the bench prompts). `specdec
distill` builds one corpus per prompt file, so adding this file only generates answers for it.

    python benchmarks/make_distill_prompts_extra.py
"""
import json
from pathlib import Path

CODE_TASKS = [
    "checks whether a year is a leap year", "converts a number to binary", "finds all even numbers in a list",
    "returns the length of the longest word in a sentence", "counts how many times a character appears",
    "swaps the keys and values of a dictionary", "computes the sum of the digits of a number",
    "checks whether a list is sorted", "returns the intersection of two lists", "removes punctuation from a string",
    "computes the median of a list", "rotates a list by k positions", "finds the most common element in a list",
    "converts a string to title case", "splits a list into chunks of size n", "checks whether a string has "
    "balanced parentheses", "computes the power set of a list", "finds the missing number in a range",
    "reverses the words in a sentence", "converts minutes to hours and minutes",
]
CODE_TEMPLATES = [
    "Write a function in Python that {task}.", "Can you write a Python program that {task}?",
    "Implement a function that {task} and explain how it works.", "Write a short Python snippet that {task}.",
]
CODE_QUESTIONS = [
    "What is the difference between a function and a method?", "What does `if __name__ == '__main__':` mean?",
    "How do dictionaries work in Python?", "What is a lambda function in Python?",
    "Explain what an API is.", "What is the difference between Python 2 and Python 3?",
    "How do I read a JSON file in Python?", "What is unit testing and why is it useful?",
    "What is the difference between a stack and a queue?", "Explain what a linked list is.",
    "How do I reverse a string in Python?", "What are Python decorators?", "What is a database index?",
    "Explain the difference between HTTP and HTTPS.", "What is an operating system?",
    "What does a CPU do?", "How does a binary search work?", "What is the difference between RAM and storage?",
    "What is cloud computing?", "How do I write a while loop in Python?", "What is a syntax error?",
    "Explain what open source software is.", "What is the difference between frontend and backend?",
    "How do I comment code in Python?", "What is a string in programming?",
]
SUBJECTS = [
    "the solar system", "tsunamis", "the nervous system", "evolution", "the Renaissance", "the Great Wall of China",
    "wind power", "nuclear energy", "bacteria", "viruses", "the ozone layer", "deserts", "rainforests", "the ocean",
    "the Industrial Revolution", "the Cold War", "ancient Greece", "the Silk Road", "the human brain", "digestion",
    "nutrition", "exercise", "vitamins", "the moon landing", "Mars", "comets", "electric cars", "3D printing",
    "artificial intelligence", "cybersecurity", "social media", "the camera", "the telephone", "money", "taxes",
    "supply and demand", "banks", "photosynthesis in plants' leaves", "friction", "sound waves",
]
EXPLAIN_TEMPLATES = [
    "Tell me about {s}.", "How does {s} work?", "Describe {s} in a few sentences.",
    "What should everyone know about {s}?", "Summarize the history of {s}.", "What are common misconceptions about {s}?",
]
CHAT = [
    "What are some tips for a first-time traveler?", "How do I stop procrastinating?",
    "Can you suggest a simple recipe with eggs?", "How do I prepare for an exam in one week?",
    "What are good habits for a healthy life?", "How can I be more confident when speaking in public?",
    "What is a good way to learn to cook?", "How do I choose a good laptop?",
    "What are some easy indoor plants for beginners?", "How can I improve my handwriting?",
    "Give me tips for a long car trip with kids.", "How can I make my mornings less stressful?",
    "What are some good questions to ask in a job interview?", "How do I organize my desk?",
    "How can I sleep better at night?", "What are fun activities for a family weekend?",
    "How can I be a better listener?", "What should I do if I can't fall asleep?",
    "Give me ideas for a healthy lunch.", "How do I start a journal?", "How do I care for a new puppy?",
    "What is the best way to memorize vocabulary?", "How can I stay motivated to exercise?",
    "Write a short poem about friendship.", "Write a haiku about the moon.", "Tell me a fun fact about space.",
    "Write a two-sentence horror story.", "Tell me a riddle and its answer.", "Write a short poem about coffee.",
    "Tell me a story about a dragon who is afraid of fire.", "Write a short thank-you message to a teacher.",
    "Write a birthday message for a friend.", "Good morning! What should I do today?",
    "Write an email asking my manager for a day off.", "Write a product description for a water bottle.",
    "What are three ways to be kinder to yourself?", "How do I apologize to a friend?",
    "What is a good name for a pet fish?", "Suggest five names for a bakery.", "What can I do to relax after work?",
]
TEXTS = [
    "The train was delayed by two hours because of heavy snow, so many passengers missed their connections.",
    "Our school is organizing a charity run next month, and all the money will go to the local animal shelter.",
    "The new smartphone has a larger screen, a better camera and a battery that lasts two full days.",
    "Researchers found that people who walk for thirty minutes a day sleep better and feel less stressed.",
    "The bakery on the corner sells the best bread in town, and there is a queue every Saturday morning.",
    "After months of planning, the community garden finally opened, with vegetables, flowers and a small pond.",
    "The company announced that employees can work from home two days a week starting in January.",
    "Volunteers cleaned the beach on Sunday and collected more than two hundred kilograms of plastic.",
    "The film received excellent reviews for its music and acting, but some critics found it too long.",
    "Learning a musical instrument improves memory and concentration, according to several studies.",
    "The storm knocked down trees across the city, and some neighborhoods were without power for a day.",
    "Our team finished the project a week early, thanks to good planning and clear communication.",
]
REWRITE_TEMPLATES = [
    "Summarize: {t}", "Rewrite this in a friendly tone: {t}", "Translate into Spanish: {t}",
    "Turn this into a question: {t}", "Explain this to a child: {t}", "Correct and improve this text: {t}",
]


def prompts() -> list[dict]:
    rows = []
    rows += [("code", t.format(task=task)) for t in CODE_TEMPLATES for task in CODE_TASKS]
    rows += [("code", q) for q in CODE_QUESTIONS]
    rows += [("explanation", t.format(s=s)) for s in SUBJECTS for t in EXPLAIN_TEMPLATES]
    rows += [("chat", c) for c in CHAT]
    rows += [("rewrite", t.format(t=text)) for text in TEXTS for t in REWRITE_TEMPLATES]
    return [{"id": f"e{i:04d}", "category": c, "split": "distill", "text": text} for i, (c, text) in enumerate(rows)]


def main() -> None:
    here = Path(__file__).parent
    taken = set()
    for name in ("prompts.jsonl", "distill_prompts.v1.jsonl"):
        taken |= {json.loads(line)["text"] for line in (here / name).read_text().splitlines() if line.strip()}
    rows = prompts()
    texts = [r["text"] for r in rows]
    assert len(set(texts)) == len(texts) and not taken & set(texts), "a prompt repeats another prompt set's"
    out = here / "distill_prompts_extra.v1.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {out}")


if __name__ == "__main__":
    main()
